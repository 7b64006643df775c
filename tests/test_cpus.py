"""The CPUs a process may use (affinity and cgroup quota) and the torch threads federation.threads gives."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from plfl import cpus
from plfl.config import validate
from plfl.errors import ConfigError


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A process allowed on 8 CPUs with an empty cgroup directory under tmp_path; returns that directory."""
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(cpus, "CGROUP", tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
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


def test_threads_come_from_the_setting_then_omp_num_threads_then_half_the_usable_cpus(machine, monkeypatch):
    (machine / "cpu.max").write_text("600000 100000\n")  # 6 usable CPUs
    assert cpus.torch_threads(None) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cpus.torch_threads(None) == 5
    assert cpus.torch_threads(2) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "auto")  # not a count: ignored
    assert cpus.torch_threads(None) == 3


def test_one_usable_cpu_still_gets_one_thread(machine):
    (machine / "cpu.max").write_text("100000 100000\n")
    assert cpus.torch_threads(None) == 1


def test_threads_below_one_are_refused_naming_the_key():
    cfg = OmegaConf.create({"method": {"name": "fedavg"}, "federation": {"threads": 0}})
    with pytest.raises(ConfigError, match=r"federation\.threads.*null or an integer >= 1"):
        validate(cfg)
