"""Federation metrics checked by hand, and W&B logging in offline mode."""

import pytest

from plfl.client import EvalResult
from plfl.experiment import run_experiment
from plfl.metrics import federation_metrics


def test_federation_metrics_by_hand():
    results = {i: EvalResult(c, n, loss) for i, (c, n, loss) in enumerate(
        [(9, 10, 0.1), (1, 10, 0.5), (30, 40, 0.2)] + [(5, 10, 1.0)] * 7 + [(0, 0, float("nan"))])}
    m = federation_metrics(results)
    assert m["accuracy"] == pytest.approx((9 + 1 + 30 + 35) / (10 + 10 + 40 + 70))
    per_client = [0.9, 0.1, 0.75] + [0.5] * 7  # the client without test samples is left out
    assert m["client_accuracy_mean"] == pytest.approx(sum(per_client) / 10)
    assert m["worst10_accuracy"] == pytest.approx(0.1)  # ⌈10 % of 10⌉ = 1 client
    assert m["test_loss"] == pytest.approx((1 + 5 + 8 + 70) / 130)


def test_wandb_offline_run_is_written(digits_config, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir, summary = run_experiment(digits_config(**{"logger.name": "wandb", "federation.rounds": 1}))
    offline_runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline_runs) == 1 and offline_runs[0].stat().st_size > 0
    assert (run_dir / "metrics.csv").is_file()  # plfl's own files are written too
    assert summary["status"] == "completed"
