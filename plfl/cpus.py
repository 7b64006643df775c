"""The CPUs this process may use, and how many threads torch's CPU operations run on (``federation.threads``).

torch starts as many intra-op threads as the machine has cores, whatever share of them the process may use:
in a container or a Slurm job limited by a CPU quota, on a core set (``taskset``), or beside another busy
process. At plfl's batch sizes an operation's threads meet at a barrier every few microseconds, so a thread that
waits for a core stalls the others, and a round can take several times as long (docs/results:
threads-fedavg-mnist). plfl therefore sets the count itself before training, from the CPUs the process may use
and how many of them are idle.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Optional

CGROUP = Path("/sys/fs/cgroup")
PROC_STAT = Path("/proc/stat")


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (``os.sched_getaffinity``; the machine's count where
    the platform has none), capped by a CFS quota of its cgroup (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``),
    rounded down, at least 1."""
    quota = cgroup_quota()
    cpus = len(allowed_cpus())
    return max(1, min(cpus, math.floor(quota)) if quota is not None else cpus)


def allowed_cpus() -> set[int]:
    """The numbers of the CPUs in this process's affinity mask (all the machine's where the platform has none)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return set(range(os.cpu_count() or 1))


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
    """The CPUs the process may use (:func:`usable_cpus`) that are idle as the run starts (:func:`idle_cpus`,
    rounded to the nearest), at least 1; all usable CPUs where the platform reports no CPU times. A busy
    neighbour's core is left to it: a thread that shares it would stall every operation's other threads."""
    usable = usable_cpus()
    idle = idle_cpus()
    return usable if idle is None else max(1, min(usable, math.floor(idle + 0.5)))


def idle_cpus(interval: float = 0.25) -> Optional[float]:
    """CPUs' worth of idle time among the CPUs this process may run on (:func:`allowed_cpus`), measured over
    ``interval`` seconds from Linux's ``/proc/stat``; this process sleeps meanwhile, so its own work does not
    count. None without ``/proc/stat`` (macOS, Windows)."""
    before = cpu_ticks()
    if before is None:
        return None
    time.sleep(interval)
    after = cpu_ticks() or {}
    idle = 0.0
    for cpu in allowed_cpus() & before.keys() & after.keys():
        idle_ticks, all_ticks = (a - b for a, b in zip(after[cpu], before[cpu]))
        idle += idle_ticks / all_ticks if all_ticks > 0 else 1.0  # no ticks counted: nothing ran there
    return idle


def cpu_ticks() -> Optional[dict[int, tuple[int, int]]]:
    """Each CPU's (idle, all) clock ticks since boot from ``/proc/stat``; idle counts I/O wait, all counts user,
    nice, system, idle, iowait, irq, softirq and steal (guest time is inside user). None without the file."""
    try:
        lines = PROC_STAT.read_text().splitlines()
    except OSError:
        return None
    ticks = {}
    for line in lines:
        name, *fields = line.split() or [""]
        if name.startswith("cpu") and name[3:].isdigit():
            counts = [int(f) for f in fields[:8]]
            ticks[int(name[3:])] = (counts[3] + counts[4], sum(counts))
    return ticks


def use_torch_threads(setting: Optional[int]) -> int:
    """Set torch's intra-op threads for ``federation.threads`` = ``setting`` (:func:`torch_threads`); returns them."""
    import torch

    threads = torch_threads(setting)
    torch.set_num_threads(threads)
    return threads
