"""The CPUs this process may use, and how many threads torch's CPU operations run on (``federation.threads``).

torch starts as many intra-op threads as the machine has cores, whatever share of them the process may use:
in a container or a Slurm job limited by a CPU quota, on a core set (``taskset``), or beside another busy
process. At plfl's batch sizes an operation's threads meet at a barrier every few microseconds, so a thread that
waits for a core stalls the others (a FedAvg round on a shared 2-core machine took 7.7 times as long with two
threads as with one). plfl therefore sets the count itself before training.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

CGROUP = Path("/sys/fs/cgroup")


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (``os.sched_getaffinity``; the machine's count where
    the platform has none), capped by a CFS quota of its cgroup (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``),
    rounded down, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    quota = cgroup_quota()
    return max(1, min(cpus, math.floor(quota)) if quota is not None else cpus)


def cgroup_quota() -> Optional[float]:
    """CPUs' worth of time per period the process's cgroup may use (a Linux CFS quota), None without one."""
    try:
        text = (CGROUP / "cpu.max").read_text().split()  # cgroup v2: "<quota> <period>" or "max <period>"
        return None if text[0] == "max" else int(text[0]) / int(text[1])
    except (OSError, IndexError, ValueError):
        pass
    try:
        quota = int((CGROUP / "cpu" / "cpu.cfs_quota_us").read_text())  # cgroup v1: -1 without a quota
        period = int((CGROUP / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 else None
    except (OSError, ValueError):
        return None


def torch_threads(setting: Optional[int]) -> int:
    """The intra-op threads for ``federation.threads`` = ``setting``: the number given, or (null) ``OMP_NUM_THREADS``
    when the environment sets it (a launcher's choice: Ray gives each worker its CPUs there), else
    :func:`default_threads`."""
    if setting is not None:
        return setting
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) >= 1 else default_threads()


def default_threads() -> int:
    """Half the CPUs the process may use (:func:`usable_cpus`), at least 1: the rest stay free for the loop's own
    work and for a busy neighbour, which would otherwise stall every operation's threads."""
    return max(1, usable_cpus() // 2)


def use_torch_threads(setting: Optional[int]) -> int:
    """Set torch's intra-op threads for ``federation.threads`` = ``setting`` (:func:`torch_threads`); returns them."""
    import torch

    threads = torch_threads(setting)
    torch.set_num_threads(threads)
    return threads
