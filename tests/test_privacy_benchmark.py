"""benchmarks/privacy.py: each cell's keys, the reported ε against the target, σ growing as ε shrinks, no DP at ε
= inf, and a finished cell not run again."""

from __future__ import annotations

import csv
import math

import pytest

from conftest import ROOT, load_script, run_main

privacy = load_script(ROOT / "benchmarks" / "privacy.py")


def test_each_cells_keys_set_the_target_epsilon_or_turn_dp_off():
    assert privacy.cell_overrides(3.0, 1e-5) == [
        "privacy.level=sample",
        "privacy.target_epsilon=3",
        "privacy.delta=1e-05",
    ]
    assert privacy.cell_overrides(math.inf, 1e-5) == ["privacy.level=none"]


@pytest.mark.slow
def test_the_table_reaches_each_target_and_a_finished_cell_is_not_run_again(tmp_path, capsys):
    args = ["--methods", "fedavg", "--epsilons", "1", "8", "inf", "--rounds", "2", "--output-dir", str(tmp_path)]
    args += ["data.source=digits", "data.root=null", "data.num_clients=5", "model=mlp", "federation.batch_size=20"]
    first = run_main(privacy, capsys, *args)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("$ ") == 3  # one run per cell
    with (tmp_path / "privacy.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["target_epsilon"] for r in rows] == ["1", "8", "inf"]
    for row, target in zip(rows[:2], (1, 8)):
        assert target - 0.01 <= float(row["epsilon"]) <= target  # Opacus' tolerance below the target
    assert float(rows[0]["noise_multiplier"]) > float(rows[1]["noise_multiplier"]) > 0
    assert (rows[2]["epsilon"], rows[2]["noise_multiplier"]) == ("inf", "0")
    assert "| fedavg | " in first.stdout
    again = run_main(privacy, capsys, *args)
    assert again.returncode == 0 and "$ " not in again.stderr
    with (tmp_path / "privacy.csv").open() as f:
        assert list(csv.DictReader(f)) == rows
