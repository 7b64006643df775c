"""The CPUs a process may use (affinity and cgroup quota), how many are idle, and the torch threads
federation.threads gives."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from plfl import cpus
from plfl.config import validate
from plfl.errors import ConfigError


def proc_stat(ticks: dict[int, tuple[int, int, int]]) -> str:
    """/proc/stat's text for CPUs -> (user, idle, iowait) ticks, the other counters 0 (and a blank line)."""
    lines = [f"cpu{cpu} {user} 0 0 {idle} {iowait} 0 0 0 0 0" for cpu, (user, idle, iowait) in ticks.items()]
    return "cpu  1 2 3 4 5 6 7 8 0 0\n" + "\n".join(lines) + "\n\nintr 12345\n"


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A process allowed on CPUs 0-7 of 10 with an empty cgroup directory under tmp_path, where in the idle
    measurement's interval CPUs 0-2 are busy, CPU 3 half busy (half of its idle time I/O wait) and the rest idle;
    returns the cgroup directory."""
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(cpus, "CGROUP", tmp_path)
    monkeypatch.setattr(cpus, "PROC_STAT", tmp_path / "stat")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = {cpu: (100, 100, 0) for cpu in range(10)}
    after = {cpu: (100 + 25, 100, 0) for cpu in range(3)}
    after |= {3: (112, 106, 6), **{cpu: (100, 125, 0) for cpu in range(4, 10)}}

    def sleep(seconds):
        assert seconds == 0.25
        (tmp_path / "stat").write_text(proc_stat(after))

    monkeypatch.setattr(cpus.time, "sleep", sleep)
    (tmp_path / "stat").write_text(proc_stat(before))
    return tmp_path


def test_without_a_quota_the_affinity_mask_counts(machine):
    assert cpus.cgroup_quota() is None
    assert cpus.usable_cpus() == 8
    (machine / "cpu.max").write_text("max 100000\n")
    assert cpus.usable_cpus() == 8


@pytest.mark.parametrize("quota, expected", [("150000 100000", 1), ("300000 100000", 3), ("50000 100000", 1)])
def test_a_cgroup_v2_quota_caps_the_cpus_rounded_down_at_least_one(machine, quota, expected):
    (machine / "cpu.max").write_text(quota + "\n")
    assert cpus.usable_cpus() == expected


def test_a_cgroup_v1_quota_caps_the_cpus_and_minus_one_means_none(machine):
    (machine / "cpu").mkdir()
    (machine / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (machine / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    assert cpus.cgroup_quota() == 2.5
    assert cpus.usable_cpus() == 2
    (machine / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpus.usable_cpus() == 8


def test_a_quota_above_the_affinity_mask_does_not_raise_the_count(machine):
    (machine / "cpu.max").write_text("1600000 100000\n")
    assert cpus.usable_cpus() == 8


def test_idle_cpus_sum_the_idle_share_of_each_allowed_cpu(machine):
    # CPUs 4-7 idle (4), CPU 3 idle 12 of 24 ticks (0.5), CPUs 0-2 busy, CPUs 8-9 outside the affinity mask
    assert cpus.idle_cpus() == pytest.approx(4.5)


def test_threads_come_from_the_setting_then_omp_num_threads_then_the_idle_usable_cpus(machine, monkeypatch):
    assert cpus.torch_threads(None) == 5  # 4.5 idle CPUs, rounded to the nearest
    (machine / "cpu.max").write_text("300000 100000\n")  # a quota of 3 CPUs caps the idle ones
    assert cpus.torch_threads(None) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cpus.torch_threads(None) == 5
    assert cpus.torch_threads(2) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "auto")  # not a count: ignored
    assert cpus.torch_threads(None) == 3


def test_without_proc_stat_every_usable_cpu_gets_a_thread(machine, monkeypatch):
    monkeypatch.setattr(cpus, "PROC_STAT", machine / "absent")
    assert cpus.idle_cpus() is None
    assert cpus.torch_threads(None) == 8


def test_a_machine_busy_on_every_cpu_still_gets_one_thread(machine, monkeypatch):
    busy = proc_stat({cpu: (125, 100, 0) for cpu in range(10)})
    monkeypatch.setattr(cpus.time, "sleep", lambda seconds: (machine / "stat").write_text(busy))
    assert cpus.torch_threads(None) == 1


def test_one_usable_cpu_still_gets_one_thread(machine):
    (machine / "cpu.max").write_text("100000 100000\n")
    assert cpus.torch_threads(None) == 1


def test_threads_below_one_are_refused_naming_the_key():
    cfg = OmegaConf.create({"method": {"name": "fedavg"}, "federation": {"threads": 0}})
    with pytest.raises(ConfigError, match=r"federation\.threads.*null or an integer >= 1"):
        validate(cfg)
