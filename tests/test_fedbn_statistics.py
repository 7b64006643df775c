"""benchmarks/fedbn_statistics.py rebuilds FedBN's evaluated models from a checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from plfl.config import load_config
from plfl.experiment import run_experiment

from conftest import load_script, run_main

ROOT = Path(__file__).resolve().parents[1]
statistics = load_script(ROOT / "benchmarks" / "fedbn_statistics.py")
CONFIG = """
data: {source: digits, num_clients: 4, partition: dirichlet, beta: 0.1}
model: {name: mlp, hidden_sizes: [32], batch_norm: true}
method: {name: %s}
federation: {rounds: 2, batch_size: 10, lr: 0.05}
progress_bar: false
keep_checkpoints: 2
"""


def fit(tmp_path: Path, method: str) -> Path:
    (tmp_path / f"{method}.yaml").write_text(CONFIG % method)
    run_dir, _ = run_experiment(load_config(tmp_path / f"{method}.yaml", [f"output_dir={tmp_path}"]))
    return run_dir


@pytest.fixture(scope="module")
def fedbn_run(tmp_path_factory) -> Path:
    return fit(tmp_path_factory.mktemp("fedbn"), "fedbn")


def test_evaluated_models_reproduce_the_runs_accuracy(fedbn_run, capsys):
    for round_ in ("1", "2"):
        result = run_main(statistics, capsys, str(fedbn_run), "--round", round_)
        assert result.returncode == 0, result.stderr
        reported = re.search(r"the run's accuracy ([0-9.]+) %", result.stdout).group(1)
        assert f"evaluated: {reported} %" in result.stdout
        assert re.search(r"re-estimated: [0-9.]+ %\nshared γ, β: [0-9.]+ %", result.stdout)


def test_a_missing_round_names_the_rounds_kept(fedbn_run, capsys):
    result = run_main(statistics, capsys, str(fedbn_run), "--round", "7")
    assert result.returncode == 1
    assert re.search(r"round-00007.pt does not exist \(kept: round-00001.pt, round-00002.pt\)", result.stderr)


def test_another_method_is_refused(tmp_path, capsys):
    result = run_main(statistics, capsys, str(fit(tmp_path, "fedavg")))
    assert result.returncode == 1 and "is a fedavg run; this reads FedBN runs" in result.stderr
