"""benchmarks/robustness.py: each cell's keys follow the malicious share, the table and CSV hold every cell, and a
finished cell is not run again while an unfinished one is continued."""

from __future__ import annotations

import argparse
import csv

import pytest

from conftest import ROOT, load_script, run_main

robustness = load_script(ROOT / "benchmarks" / "robustness.py")


def test_each_cells_keys_follow_the_malicious_share():
    args = argparse.Namespace(fraction=0.2, scale=4.0, noise_std=0.5, max_norm=2.0)
    cell = robustness.cell_overrides
    assert cell("none", "mean", args, 20, 4) == ["aggregation.rule=mean"]
    assert cell("sign_flip", "multi_krum", args, 20, 4) == [
        "aggregation.rule=multi_krum",
        "attack.kind=sign_flip",
        "attack.fraction=0.2",
        "attack.scale=4.0",
        "aggregation.byzantine=4",
        "aggregation.selected=16",
    ]
    assert cell("gaussian", "trimmed_mean", args, 20, 4)[3:] == ["attack.noise_std=0.5", "aggregation.trim=0.2"]
    assert cell("label_flip", "norm_bound", args, 20, 4)[3:] == ["aggregation.max_norm=2.0"]


@pytest.mark.slow
def test_the_table_holds_every_cell_reuses_a_finished_cell_and_continues_a_shorter_one(tmp_path, capsys):
    args = ["--methods", "fedavg", "--attacks", "none", "backdoor", "--rules", "mean", "median", "--rounds", "1"]
    args += ["--output-dir", str(tmp_path), "data.source=digits", "data.root=null", "data.num_clients=5", "model=mlp"]
    first = run_main(robustness, capsys, *args)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("$ ") == 4  # one run per cell
    with (tmp_path / "robustness.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["attack"], r["rule"]) for r in rows] == [
        ("none", "mean"),
        ("none", "median"),
        ("backdoor", "mean"),
        ("backdoor", "median"),
    ]
    assert all(0 <= float(r["accuracy"]) <= 100 for r in rows)
    assert [bool(r["backdoor_success"]) for r in rows] == [False, False, True, True]
    assert "| fedavg | backdoor | " in first.stdout
    again = run_main(robustness, capsys, *args)
    assert again.returncode == 0 and "$ " not in again.stderr
    with (tmp_path / "robustness.csv").open() as f:
        assert list(csv.DictReader(f)) == rows
    # A cell that stopped before --rounds (here: run for 1 round, asked for 2) continues from its checkpoint.
    longer = run_main(robustness, capsys, *args[:6], "mean", "--rounds", "2", *args[10:])
    assert longer.returncode == 0, longer.stderr
    assert longer.stderr.count("$ ") == 2 and longer.stderr.count("--resume") == 2
    for cell in ("fedavg-none-mean", "fedavg-backdoor-mean"):
        (run_dir,) = (tmp_path / cell).iterdir()
        with (run_dir / "metrics.csv").open() as f:
            assert [r["round"] for r in csv.DictReader(f)] == ["0", "1", "2"]
