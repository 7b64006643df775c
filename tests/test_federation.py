"""FedAvg aggregation, the reused Trainer, the loop's round structure and reproducibility."""

import lightning as L
import pytest
import torch

from plfl.experiment import run_experiment
from plfl.methods.fedala import FedALA, FedALAConfig
from plfl.methods.fedavg import FedAvg, FedAvgConfig
from plfl.robust import weighted_average

from conftest import make_context, run_hook, sequential


def test_weighted_average_matches_hand_computation():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(7)}
    b = {"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(9)}
    avg = weighted_average([a, b], [1, 3])
    assert torch.allclose(avg["w"], torch.tensor([(1 + 3 * 4) / 4, (2 + 3 * 8) / 4]))
    assert avg["n"].item() == 7  # integer buffers are not averaged


def test_fedavg_aggregate_is_sample_weighted_mean(tiny_federation):
    context, model = make_context(tiny_federation)
    method = FedAvg(FedAvgConfig(), context, {k: v.clone() for k, v in model.state_dict().items()})
    messages = {i: {"w": torch.full((3,), float(i))} for i in (0, 2, 3)}
    method.aggregate(messages, round_=1)
    n = [tiny_federation.clients[i].num_train for i in (0, 2, 3)]  # 10, 30, 40
    expected = (0 * n[0] + 2 * n[1] + 3 * n[2]) / sum(n)
    assert torch.allclose(method.global_params["w"], torch.full((3,), expected))


def test_reused_trainer_trains_every_client(tiny_federation):
    context, model = make_context(tiny_federation)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    for i, client in enumerate(tiny_federation.clients):
        epochs = 2
        result = sequential(context).trainer.train(start, client.x_train, client.y_train, seed=i, epochs=epochs)
        assert result.samples_seen == epochs * client.num_train  # the 2nd, 3rd... fit really trains
        assert not torch.equal(result.params["head.weight"], start["head.weight"])
    steps = sequential(context).trainer.train(start, client.x_train, client.y_train, seed=0, steps=3)
    assert steps.samples_seen == 3 * 5  # three batches of 5


def test_frozen_parameters_stay_bit_identical(tiny_federation):
    context, model = make_context(tiny_federation)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    client = tiny_federation.clients[1]
    result = sequential(context).trainer.train(
        start, client.x_train, client.y_train, seed=0, epochs=1, trainable={"head.weight", "head.bias"}
    )
    assert torch.equal(result.params["body.1.weight"], start["body.1.weight"])
    assert not torch.equal(result.params["head.weight"], start["head.weight"])


def test_ala_skipped_at_first_initialisation_then_runs(tiny_federation):
    context, model = make_context(tiny_federation, batch_size=5)
    global_params = {k: v.clone() for k, v in model.state_dict().items()}
    method = FedALA(FedALAConfig(max_init_epochs=3), context, global_params)
    first = run_hook(context, method.pre_local_init(0, global_params, round_=0))
    assert all(torch.equal(first[k], global_params[k]) for k in global_params)
    assert context.store.get(0, "ala_weights") is None  # nothing learned in round 0
    context.store.set(0, "model", {k: v + 0.5 for k, v in first.items()})
    with pytest.warns(Warning):
        second = run_hook(context, method.pre_local_init(0, global_params, round_=1))
    assert set(context.store.get(0, "ala_weights")) == {"head.weight", "head.bias"}
    assert torch.equal(second["body.1.weight"], global_params["body.1.weight"])


def test_trainer_is_created_once_per_run(digits_config, monkeypatch):
    created = []
    original = L.Trainer.__init__

    def counting_init(self, *args, **kwargs):
        created.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(L.Trainer, "__init__", counting_init)
    run_dir, summary = run_experiment(digits_config(**{"method.name": "fedala"}))
    assert summary["status"] == "completed" and summary["rounds"] == 3
    assert len(created) == 1  # 5 clients × 3 rounds of fits and 4 evaluations on one Trainer


def test_rounds_evaluated_and_communication_counted(digits_config):
    run_dir, summary = run_experiment(digits_config(**{"federation.join_ratio": 0.4}))
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 4  # header + rounds 0..3
    n_params = summary["num_parameters"]
    assert summary["params_sent_per_round"] == 5 * n_params  # broadcast to every client
    assert summary["params_received_per_round"] == 2 * n_params  # int(0.4·5) clients upload
    assert summary["bytes_sent_per_round"] == 4 * 5 * n_params  # float32
    clients = (run_dir / "clients.csv").read_text().splitlines()
    assert len(clients) == 1 + 4 * 5


def test_local_sends_nothing(digits_config):
    _, summary = run_experiment(digits_config(**{"method.name": "local"}))
    assert summary["params_sent_per_round"] == 0 and summary["params_received_per_round"] == 0
    assert summary["best_accuracy"] > 0.5


def test_same_seed_same_metrics(digits_config):
    def read(d):
        return (d / "clients.csv").read_text()

    a, _ = run_experiment(digits_config(**{"method.name": "fedala"}))
    b, _ = run_experiment(digits_config(**{"method.name": "fedala"}))
    c, _ = run_experiment(digits_config(**{"method.name": "fedala", "federation.seed": 1}))
    assert read(a) == read(b)
    assert read(a) != read(c)


def test_ala_switched_on_for_fedavg_learns_weights(digits_config):
    run_dir, _ = run_experiment(digits_config(**{"method.name": "fedavg", "method.ala.s": 50}))
    header, *rows = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()]
    weight_mean = [row[header.index("ala_weight_mean")] for row in rows]
    assert weight_mean[0] == ""  # round 0: ALA skipped, no weights yet
    assert all(0 <= float(w) <= 1 for w in weight_mean[1:])
