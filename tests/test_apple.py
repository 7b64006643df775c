"""APPLE: the step in w_i^(c) and p_i by hand on a linear model, the schedule of μ, what is sent and
evaluated, and an end-to-end run (momentum and data.augment are refused: test_bad_input.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plfl.executors.steps import FunctionalNetwork
from plfl.experiment import run_experiment
from plfl.methods.apple import APPLE, RELATIONSHIPS, APPLEConfig, APPLEStep, proximal_weight
from plfl.methods.base import nbytes, numel
from plfl.tasks import Batch

from conftest import last_metrics, make_context, run_hook, run_loop, sequential


def make_method(data, federation=None, **keys):
    context, model = make_context(data, **{"rounds": 2, "lr": 0.1, "batch_size": 5, **(federation or {})})
    return APPLE(APPLEConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_step_takes_the_hand_computed_gradients_on_a_linear_model():
    g = torch.Generator().manual_seed(0)
    n, i, batch = 3, 1, 4
    cores = {"weight": torch.randn(n, 2, 3, generator=g), "bias": torch.randn(n, 2, generator=g)}
    own = {k: v[i].clone() for k, v in cores.items()}
    p, p0 = torch.tensor([0.2, 0.5, 0.3]), torch.tensor([0.1, 0.6, 0.3])
    x, y = torch.randn(batch, 3, generator=g), torch.tensor([0, 1, 1, 0])
    weight, core_lr, dr_lr = 0.4, 0.1, 0.05
    step = APPLEStep(("weight", "bias"), weight, core_lr, dr_lr)
    # The shared cores' row i is replaced by the state's own core: a stale row i must not count.
    shared = {k: v.index_fill(0, torch.tensor([i]), 7.0) for k, v in cores.items()}
    inputs = {"own_index": F.one_hot(torch.tensor(i), n).float(), "p0": p0}
    out = step(
        FunctionalNetwork(nn.Linear(3, 2), torch.device("cpu")),
        {**own, RELATIONSHIPS: p},
        inputs,
        shared,
        Batch(x, y, None),
    )
    new_own, new_p, loss = {k: out.state[k] for k in own}, out.state[RELATIONSHIPS], out.loss.item()
    assert out.samples == batch

    # w^(p) = Σ_j p_j w_j; softmax regression: ∂CE/∂z = (softmax(z) − onehot(y)) / B, ∂CE/∂W = dzᵀ x.
    w = {k: sum(p[j] * v[j] for j in range(n)) for k, v in cores.items()}
    z = x @ w["weight"].T + w["bias"]
    dz = (z.softmax(1) - F.one_hot(y, 2)) / batch
    grad = {"weight": dz.T @ x, "bias": dz.sum(0)}
    # ∂/∂p_j = ⟨∇F, w_j⟩ + λμ (p_j − p0_j); ∂/∂w_i = p_i ∇F.
    grad_p = torch.stack([sum((grad[k] * v[j]).sum() for k, v in cores.items()) for j in range(n)])
    torch.testing.assert_close(new_p, p - dr_lr * (grad_p + weight * (p - p0)))
    for k in cores:
        torch.testing.assert_close(new_own[k], own[k] - core_lr * p[i] * grad[k])
    assert loss == pytest.approx(-z.log_softmax(1)[torch.arange(batch), y].mean().item())


def test_proximal_weight_follows_the_cosine_schedule_to_zero_at_l():
    mu, end = 0.1, 10
    assert proximal_weight(0, mu, end) == mu
    assert proximal_weight(end // 2, mu, end) == pytest.approx(mu / 2)
    assert proximal_weight(end, mu, end) == proximal_weight(end + 3, mu, end) == 0.0
    assert 0 < proximal_weight(8, mu, end) < proximal_weight(2, mu, end) < mu  # falling in between
    assert proximal_weight(0, mu, 0) == 0.0  # L = 0: no term at all


def test_every_client_downloads_all_cores_and_evaluates_their_mixture(tiny_federation):
    method, context = make_method(tiny_federation, dr_lr=0.1)
    initial = {k: v[0].clone() for k, v in method.cores.items()}
    sizes = torch.tensor([c.num_train for c in tiny_federation.clients], dtype=torch.float32)
    torch.testing.assert_close(method.p0, sizes / sizes.sum())  # p_i^(0): the training-set shares
    loop = run_loop(method, context)
    n = len(tiny_federation.clients)
    for result in loop.history:
        assert result.metrics["bytes_sent"] == n * n * nbytes(initial)  # N cores to each of N clients
        assert result.metrics["params_sent"] == n * n * numel(initial)
    assert loop.history[-1].metrics["bytes_received"] == n * nbytes(initial)  # each uploads its own core

    cores = method.cores
    assert not torch.equal(cores["head.weight"][0], cores["head.weight"][1])  # the cores were trained
    for row in loop.history[-1].clients:
        i = row["client"]
        p = context.store.get(i, RELATIONSHIPS)
        assert not torch.allclose(p, method.p0)  # learned
        evaluated = context.store.get(i, "model")
        for key, stacked in cores.items():
            torch.testing.assert_close(evaluated[key], torch.tensordot(p, stacked, dims=1))  # Σ_j p_ij w_j^(c)
        data = tiny_federation.clients[i]
        assert sequential(context).trainer.evaluate(evaluated, data.x_test, data.y_test).correct == row["correct"]
    assert loop.history[-1].metrics["dr_self_mean"] == pytest.approx(
        sum(context.store.get(i, RELATIONSHIPS)[i].item() for i in range(n)) / n
    )


def test_training_moves_only_the_own_core_and_keeps_the_mixture(tiny_federation):
    method, context = make_method(tiny_federation, dr_lr=0.1)
    client = 2
    message = method.server_message(client, 0)  # the broadcast before round 1
    params = run_hook(context, method.pre_local_init(client, message, 1))
    result = run_hook(context, method.local_train(client, params, message, 1))
    p = context.store.get(client, RELATIONSHIPS)
    upload = method.client_message(client, result, 1)
    assert upload is result.upload and list(upload) == list(params)
    assert not torch.equal(upload["head.weight"], method.cores["head.weight"][client])
    cores = {k: v.clone() for k, v in method.cores.items()}
    for k in cores:
        cores[k][client] = upload[k]
    for key, value in result.params.items():  # the trained personalized model: new p_i over the new own core
        torch.testing.assert_close(value, torch.tensordot(p, cores[key], dims=1))


@pytest.mark.slow
def test_apple_config_runs_end_to_end(digits_config):
    run_dir, summary = run_experiment(digits_config(**{"method.name": "apple", "federation.rounds": 5}))
    last = last_metrics(run_dir)
    assert float(last["accuracy"]) > 0.4  # 10 classes: chance is 0.1 (measured 0.65; FedAvg 0.26 at round 3)
    assert float(last["dr_self_mean"]) > 0.2  # p_ii grew from the shares' mean 1/5 (measured 0.32)
    assert float(last["bytes_sent"]) == 5 * float(last["bytes_received"])  # 5 cores down, 1 up per client
