"""Failing clients are left out of their round; too many failures or a diverged global model stop the run."""

import csv
import json

import pytest
import torch

from plfl.errors import FederationError, PlflWarning
from plfl.experiment import run_experiment
from plfl.methods.fedavg import FedAvg


@pytest.fixture
def faulty_clients(monkeypatch):
    """Client 1 always raises; client 3 returns a NaN weight from round 2 on. Records who was aggregated."""
    train, aggregate = FedAvg.local_train, FedAvg.aggregate
    aggregated = {}

    def local_train(self, client_id, params, message, round_):
        if client_id == 1:
            raise RuntimeError("disk on fire")
        result = yield from train(self, client_id, params, message, round_)
        if client_id == 3 and round_ >= 2:
            result.params["head.weight"][0, 0] = float("nan")
        return result

    def recording_aggregate(self, messages, round_):
        aggregated[round_] = sorted(messages)
        aggregate(self, messages, round_)

    monkeypatch.setattr(FedAvg, "local_train", local_train)
    monkeypatch.setattr(FedAvg, "aggregate", recording_aggregate)
    return aggregated


def only_run_dir(parent):
    (run_dir,) = parent.iterdir()
    return run_dir


def test_failing_and_nan_clients_are_left_out_with_a_warning(digits_config, faulty_clients):
    with pytest.warns(PlflWarning) as caught:
        run_dir, summary = run_experiment(digits_config(**{"method.name": "fedavg"}))
    messages = {str(w.message) for w in caught}
    assert (
        "Round 1: client 1 is left out of the aggregation: local training raised RuntimeError: disk on fire."
        in messages
    )
    assert (
        "Round 2: client 3 is left out of the aggregation: its trained parameter 'head.weight' holds NaN or "
        "Inf (training diverged)." in messages
    )
    assert faulty_clients == {1: [0, 2, 3, 4], 2: [0, 2, 4], 3: [0, 2, 4]}
    assert [(f["round"], f["client"]) for f in summary["client_failures"]] == [(1, 1), (2, 1), (2, 3), (3, 1), (3, 3)]
    with open(run_dir / "metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    assert [row["failed_clients"] for row in metrics] == ["", "1", "2", "2"]
    # The NaN never reached the global model: the others kept learning (chance is 0.1).
    assert summary["status"] == "completed" and summary["final_accuracy"] > float(metrics[0]["accuracy"]) + 0.1


def test_more_failures_than_allowed_fail_the_round_and_keep_the_finished_ones(digits_config, faulty_clients, tmp_path):
    cfg = digits_config(**{"method.name": "fedavg", "federation.max_failed_clients": 1})
    with pytest.warns(PlflWarning), pytest.raises(FederationError) as error:
        run_experiment(cfg)
    assert str(error.value).startswith(
        "Round 2: 2 of 5 clients failed (federation.max_failed_clients=1): client 1: local training raised "
        "RuntimeError: disk on fire; client 3: its trained parameter 'head.weight' holds NaN or Inf"
    )
    run_dir = only_run_dir(tmp_path / cfg.name)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("FederationError: Round 2: 2 of 5")
    assert summary["rounds"] == 1  # rounds 0 and 1 finished
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["round-00000.pt", "round-00001.pt"]


def test_all_clients_failing_stops_the_run(digits_config, monkeypatch):
    monkeypatch.setattr(FedAvg, "local_train", lambda *args: (_ for _ in ()).throw(ValueError("bad batch")))
    with (
        pytest.warns(PlflWarning),
        pytest.raises(
            FederationError,
            match=r"^Round 1: all 5 clients failed: "
            r"client 0: local training raised "
            r"ValueError: bad batch;",
        ),
    ):
        run_experiment(digits_config(**{"method.name": "fedavg"}))


def test_a_diverged_global_model_stops_the_run_and_keeps_the_last_good_checkpoint(digits_config, monkeypatch, tmp_path):
    aggregate = FedAvg.aggregate

    def diverging(self, messages, round_):
        aggregate(self, messages, round_)
        if round_ == 2:
            self.global_params["body.1.bias"] = torch.full_like(self.global_params["body.1.bias"], float("inf"))

    monkeypatch.setattr(FedAvg, "aggregate", diverging)
    cfg = digits_config(**{"method.name": "fedavg"})
    message = (
        r"^Round 2: the global model holds NaN or Inf in 'body.1.bias' after aggregation: the federation "
        r"diverged. Lower federation.lr \(now 0.05\) and start again, or continue from the last good "
        r"checkpoint with plfl fit --resume RUN_DIR federation.lr=..."
    )
    with pytest.raises(FederationError, match=message):
        run_experiment(cfg)
    run_dir = only_run_dir(tmp_path / cfg.name)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "the global model holds NaN or Inf" in summary["error"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["round-00000.pt", "round-00001.pt"]
