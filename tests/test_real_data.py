"""FedALA on the real MNIST Dir(0.1) federation of the FedALA paper (../shared/data)."""

import csv
import json
from pathlib import Path

import pytest

from plfl.config import load_config
from plfl.experiment import run_experiment

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fedala_on_real_mnist_matches_the_reference_code_after_one_round(tmp_path, fedala_mnist):
    """Round 1 holds one round of local training, FedAvg, and ALA's initial stage on every client. On the
    vectorized executor, twice as fast as the sequential one on a CPU too; tests/test_executors.py holds the two
    to the same numbers."""
    options = ["federation.rounds=1", "federation.executor=vectorized", "progress_bar=false"]
    cfg = load_config(
        ROOT / "configs" / "fedala.yaml", [*options, f"data.root={fedala_mnist}", f"output_dir={tmp_path}"]
    )
    run_dir, summary = run_experiment(cfg)
    with open(run_dir / "metrics.csv") as f:
        rounds = list(csv.DictReader(f))
    accuracy = [float(r["accuracy"]) for r in rounds]
    # The reference code on the same data and settings: r0 5.88 %, r1 82.60 %. plfl's seed 0 gave
    # 5.88 and 81.56 %; 1.5 points leave room for batch order, not for a broken ALA or aggregation.
    assert accuracy[0] == pytest.approx(0.0588, abs=0.001)
    assert accuracy[1] == pytest.approx(0.8260, abs=0.015)
    assert rounds[0]["ala_weight_mean"] == ""  # ALA skips each client's first initialisation
    assert float(rounds[1]["ala_epochs_mean"]) > 10  # the initial stage: more than num_pre_loss epochs
    assert 0 <= float(rounds[1]["ala_weight_mean"]) <= 1
    assert summary["best_round"] == 1
    assert json.loads((run_dir / "summary.json").read_text())["best_accuracy"] == accuracy[1]
