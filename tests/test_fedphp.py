"""FedPHP: MMD² by hand, the inheritance weight's schedule and the moving average, the client loop
against an independent one, what is evaluated and sent, and an end-to-end run (momentum and data.augment are
refused: test_bad_input.py)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from plfl.batches import batch_loader, last_batch_minimum, training_rows
from plfl.experiment import run_experiment
from plfl.methods.base import nbytes
from plfl.methods.fedphp import FedPHP, FedPHPConfig, inherit, inheritance_weight, mmd
from plfl.models import build_model
from plfl.seeding import derive_seed

from conftest import last_metrics, make_context, run_hook, run_loop, sequential


def make_method(data, federation=None, **keys):
    context, model = make_context(data, **{"rounds": 4, "lr": 0.1, "batch_size": 5, **(federation or {})})
    return FedPHP(FedPHPConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_mmd_is_zero_for_identical_features_and_positive_by_hand_otherwise():
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    assert mmd(x, x.clone()).item() == 0.0

    # x = (0, 2), y = (1, 1) in one dimension: squared distances xx (0, 4; 4, 0), yy all 0, xy all 1.
    def k(d):
        return sum(math.exp(-d / (2 * s)) for s in (10, 15, 20, 50))

    expected = (2 * k(0) + 2 * k(4)) / 4 + k(0) - 2 * k(1)

    def x64(*values):
        return torch.tensor(values, dtype=torch.float64).unsqueeze(1)  #  exact enough

    got = mmd(x64(0.0, 2.0), x64(1.0, 1.0)).item()
    assert got == pytest.approx(expected) and got > 0
    assert mmd(x, x + 1).item() > 0


def test_inheritance_weight_grows_linearly_from_zero_and_inherit_mixes():
    assert inheritance_weight(1, 0.9, 10) == 0.0  # the first training: v_i becomes the trained w
    assert inheritance_weight(6, 0.9, 10) == pytest.approx(0.45)
    assert inheritance_weight(11, 0.9, 10) == inheritance_weight(15, 0.9, 10) == pytest.approx(0.9)  # capped at μ
    v = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(4)}
    w = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(9)}
    mixed = inherit(v, w, 0.25)
    assert torch.equal(mixed["w"], torch.tensor([1.5, 3.0])) and mixed["n"].item() == 9


def test_client_loop_matches_an_independent_one(tiny_federation):
    lam, lr, client, round_ = 0.3, 0.1, 1, 3  # client 1: 20 samples, 4 batches of 5; μ_3 = 0.9 · 2 / 4
    method, context = make_method(tiny_federation, lam=lam)
    received = method.server_message(client, round_ - 1)  # the broadcast before round 3
    v = {k: t + 0.3 * torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) for k, t in received.items()}
    result = run_hook(context, method.local_train(client, v, received, round_))

    local, personal = copy.deepcopy(context.architecture), copy.deepcopy(context.architecture)
    local.load_state_dict(received)
    personal.load_state_dict(v)
    data = tiny_federation.clients[client]
    for x, y in batch_loader(data.x_train, data.y_train, 5, derive_seed(0, round_, client, "local_training")):
        features = local.body(x)
        loss = (1 - lam) * F.cross_entropy(local.head(features), y) + lam * mmd(features, personal.body(x).detach())
        grads = torch.autograd.grad(loss, list(local.parameters()))
        with torch.no_grad():
            for p, g in zip(local.parameters(), grads):
                p -= lr * g
    trained = local.state_dict()
    mu = 0.9 * 2 / 4
    for key in received:
        torch.testing.assert_close(result.upload[key], trained[key])  # w: uploaded
        torch.testing.assert_close(result.params[key], mu * v[key] + (1 - mu) * trained[key])  # v_i inherits
    assert method.client_message(client, result, round_) is result.upload
    assert result.samples_seen == data.num_train
    assert all(torch.equal(method.global_params[k], t) for k, t in received.items())  # w^t untouched


def test_inherited_model_is_what_each_client_evaluates(tiny_federation):
    method, context = make_method(tiny_federation, {"rounds": 2})
    loop = run_loop(method, context)
    last = loop.history[-1]
    size = nbytes(method.global_params)
    assert last.metrics["bytes_sent"] == last.metrics["bytes_received"] == 4 * size  # one model each way
    for row in last.clients:
        personal = context.store.get(row["client"], "model")
        assert not torch.equal(personal["head.weight"], method.global_params["head.weight"])
        data = tiny_federation.clients[row["client"]]
        assert sequential(context).trainer.evaluate(personal, data.x_test, data.y_test).correct == row["correct"]
    assert "global_accuracy" in last.metrics


def test_batchnorm_statistics_go_with_w_and_a_single_sample_batch_is_left_out(tiny_federation):
    model = build_model("mlp", (8,), 3, hidden_sizes=[16], batch_norm=True)
    context, _ = make_context(tiny_federation, model=model, batch_size=3, lr=0.1)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    method = FedPHP(FedPHPConfig(), context, {k: v.clone() for k, v in initial.items()})
    data = tiny_federation.clients[0]  # 10 samples: batches of 3, 3, 3 and one sample, left out

    def sizes(batch_norm: bool, epochs: int) -> list[int]:  # real samples per batch of the one order
        rows = training_rows(data.num_train, 3, seed=5, epochs=epochs, min_last=last_batch_minimum(3, batch_norm))
        return (rows >= 0).sum(1).tolist()

    assert sizes(True, 2) == [3, 3, 3] * 2
    assert sizes(False, 1) == [3, 3, 3, 1]
    result = run_hook(context, method.local_train(0, initial, method.server_message(0, 0), 1))
    assert result.samples_seen == 9 and list(result.upload) == list(initial)
    assert all(torch.equal(method.global_params[k], v) for k, v in initial.items())  # w^t's statistics untouched
    stats = "body.2.running_mean"  # Flatten, Linear, BatchNorm1d, ReLU
    assert not torch.equal(result.upload[stats], initial[stats])
    assert torch.equal(result.params[stats], result.upload[stats])  # μ_1 = 0: v_i is w, statistics too
    assert result.upload["body.2.num_batches_tracked"].item() == 3


@pytest.mark.slow
def test_fedphp_config_runs_end_to_end(digits_config):
    run_dir, summary = run_experiment(digits_config(**{"method.name": "fedphp", "federation.rounds": 5}))
    last = last_metrics(run_dir)
    assert float(last["accuracy"]) > 0.4  # 10 classes: chance is 0.1 (measured 0.50; its global model 0.37)
    assert float(last["accuracy"]) != float(last["global_accuracy"])
