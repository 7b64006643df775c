"""Ditto: the personal step's pull λ(v − w), the uploaded global copy and what is evaluated."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from plfl.batches import batch_loader
from plfl.checkpoint import load_latest_checkpoint
from plfl.experiment import run_experiment
from plfl.methods.base import nbytes
from plfl.methods.ditto import Ditto, DittoConfig
from plfl.seeding import derive_seed

from conftest import last_metrics, make_context, run_hook, run_loop, sequential


def make_method(data, federation=None, **keys):
    context, model = make_context(data, rounds=1, **(federation or {}))  # lr 0.1, batch 5
    return Ditto(DittoConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_personal_step_adds_lambda_pull_and_upload_is_fedavgs_global_copy(tiny_federation):
    lam, lr, client = 0.5, 0.1, 1  # client 1: 20 samples, 4 batches of 5
    method, context = make_method(tiny_federation, lam=lam)
    w = method.global_params
    v = {k: t + 0.3 * torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) for k, t in w.items()}
    result = run_hook(context, method.local_train(client, v, w, round_=2))  # w: the received global model

    # Independent SGD on CE(v) + λ/2‖v − w‖²: v ← v − lr (∇CE(v) + λ (v − w)), same batch order.
    data = tiny_federation.clients[client]
    expected = {k: t.clone().requires_grad_() for k, t in v.items()}
    for x, y in batch_loader(data.x_train, data.y_train, 5, derive_seed(0, 2, client, "personal_training")):
        loss = F.cross_entropy(functional_call(context.architecture, expected, (x,)), y)
        grads = torch.autograd.grad(loss, list(expected.values()))
        with torch.no_grad():
            expected = {
                k: (t - lr * (g + lam * (t - w[k]))).requires_grad_() for (k, t), g in zip(expected.items(), grads)
            }
    for key, value in expected.items():
        torch.testing.assert_close(result.params[key], value.detach())

    # The upload is FedAvg's local training from w (the received global), bit for bit.
    fedavg = sequential(context).trainer.train(
        w, data.x_train, data.y_train, seed=derive_seed(0, 2, client, "local_training"), epochs=1
    )
    assert all(torch.equal(result.upload[k], t) for k, t in fedavg.params.items())
    assert method.client_message(client, result, round_=2) is result.upload
    assert result.samples_seen == 2 * data.num_train  # one personal and one global epoch


@pytest.mark.parametrize(
    "federation, keys, samples",
    [
        ({"local_steps": 3}, {}, (15, 15)),  # a fixed-steps protocol: both models train 3 batches of 5
        ({"local_epochs": 2}, {}, (40, 40)),
        ({"local_steps": 3}, {"personal_epochs": 1}, (20, 15)),
        ({"local_epochs": 2}, {"personal_epochs": 1}, (20, 40)),
    ],
)
def test_personal_model_trains_as_long_as_the_global_copy_unless_personal_epochs_is_set(
    tiny_federation, federation, keys, samples
):
    method, context = make_method(tiny_federation, federation, **keys)
    w = method.global_params
    seen = []
    executor = sequential(context)
    train = executor.train

    def counted(tasks):  # the samples each training of client 1 (20 samples) sees, personal model first
        results = train(tasks)
        seen.extend(result.samples_seen for result in results)
        return results

    executor.train = counted
    run_hook(context, method.local_train(1, w, w, round_=0), executor)
    assert tuple(seen) == samples


def test_personal_model_is_what_each_client_evaluates(tiny_federation):
    method, context = make_method(tiny_federation)
    loop = run_loop(method, context)
    last = loop.history[-1]
    assert last.metrics["bytes_received"] == 4 * nbytes(method.global_params)  # one model per client
    for row in last.clients:
        personal = context.store.get(row["client"], "model")
        assert not torch.equal(personal["head.weight"], method.global_params["head.weight"])
        data = tiny_federation.clients[row["client"]]
        assert sequential(context).trainer.evaluate(personal, data.x_test, data.y_test).correct == row["correct"]


def test_global_model_is_fedavgs_bit_for_bit(digits_config):
    fedavg, _ = run_experiment(digits_config(**{"method.name": "fedavg"}))
    ditto, summary = run_experiment(digits_config(**{"method.name": "ditto"}))
    expected = load_latest_checkpoint(fedavg / "checkpoints")[1]["method"]["global_params"]
    got = load_latest_checkpoint(ditto / "checkpoints")[1]["method"]["global_params"]
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    last = last_metrics(ditto)
    assert float(last["accuracy"]) > 0.3  # 10 classes: chance is 0.1 (measured 0.50 personal, 0.26 global)
    assert float(last["accuracy"]) != float(last["global_accuracy"])
