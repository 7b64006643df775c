"""FedDBE: Mean Regularization and the folded head by hand, the client's steps and the initialization period
against an independent loop (PFLlib's order of operations), the consensus formed once and counted both ways, and
the PRBM kept in the store and never sent."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from plfl.batches import batch_loader
from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.methods.base import numel
from plfl.methods.feddbe import (
    CONSENSUS,
    LOCAL_MEAN,
    PRBM,
    FedDBE,
    FedDBEConfig,
    consensus_mean,
    folded_head,
    masked_feature_mean,
    mean_regularization,
    running_mean,
)
from plfl.models import build_model
from plfl.seeding import derive_seed

from conftest import ROOT, make_context, run_hook, run_loop


def make_method(data, model=None, kappa=5.0, mu=0.3, **federation):
    context, model = make_context(data, model=model, rounds=2, **federation)  # lr 0.1, batch size 5
    config = FedDBEConfig("feddbe", kappa=kappa, mu=mu)
    return FedDBE(config, context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_mean_regularization_and_running_mean_match_hand_computation():
    # F = 2: κ · ((0.5 · 1²) + (0.5 · 2²)) / 2 = κ · 1.25.
    local, consensus = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    assert mean_regularization(local, consensus, 4.0).item() == pytest.approx(5.0)
    assert mean_regularization(local, local, 4.0).item() == 0
    # z̄ ← 0.7 · (1, 0) + 0.3 · (2, 4) = (1.3, 1.2); μ = 1 keeps the batch's mean alone.
    torch.testing.assert_close(running_mean(local, torch.tensor([2.0, 4.0]), 0.3), torch.tensor([1.3, 1.2]))
    torch.testing.assert_close(running_mean(local, torch.tensor([2.0, 4.0]), 1.0), torch.tensor([2.0, 4.0]))
    # The padded row (mask 0) does not count in the batch's mean.
    features = torch.tensor([[1.0, 2.0], [3.0, 6.0], [100.0, 100.0]])
    torch.testing.assert_close(masked_feature_mean(features, torch.tensor([1.0, 1.0, 0.0])), torch.tensor([2.0, 4.0]))
    # The consensus weights each client's mean by its samples: (1·(1, 0) + 3·(0, 2)) / 4.
    torch.testing.assert_close(consensus_mean([local, consensus], [1, 3]), torch.tensor([0.25, 1.5]))
    with pytest.raises(ValueError, match="cannot average 0 feature means"):
        consensus_mean([], [])


def test_folded_head_adds_the_prbm_to_the_features_before_the_head(tiny_federation):
    model = build_model("mlp", (8,), 3, hidden_sizes=[16], batch_norm=True).eval()
    params = model.state_dict()
    prbm = torch.randn(16, generator=torch.Generator().manual_seed(2))
    x = tiny_federation.clients[0].x_test
    expected = model.head(model.body(x) + prbm)
    torch.testing.assert_close(functional_call(model, folded_head(params, prbm), (x,)), expected)
    assert folded_head(params, prbm)["head.weight"] is params["head.weight"]


def independent_training(architecture, start, prbm, consensus, data, seed, kappa, mu, lr):
    """PFLlib's client loop: per batch, the running mean takes the batch's mean feature (earlier batches
    detached); SGD of the model and the PRBM on CE(head(z + p)) + κ · mean ½ (z̄ − z̄^g)², or CE(head(z)) alone
    without a consensus (the initialization period)."""
    model = copy.deepcopy(architecture)
    model.load_state_dict(start)
    p = nn.Parameter(prbm.clone())
    optimizers = [torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD([p], lr=lr)]
    mean = torch.zeros_like(prbm)
    for x, y in batch_loader(data.x_train, data.y_train, 5, seed):
        features = model.body(x)
        mean = (1 - mu) * mean + mu * features.mean(0)
        if consensus is None:
            loss = F.cross_entropy(model.head(features), y)
        else:
            loss = F.cross_entropy(model.head(features + p), y) + kappa * (0.5 * (mean - consensus) ** 2).mean()
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        mean = mean.detach()
    return model.state_dict(), p.detach(), mean


def test_client_steps_match_an_independent_loop(tiny_federation):
    client = 2  # 30 samples, 6 batches of 5
    method, context = make_method(tiny_federation)
    received = {k: t + 0.01 for k, t in method.global_params.items()}
    g = torch.Generator().manual_seed(1)
    prbm, consensus = torch.randn(16, generator=g), torch.rand(16, generator=g)
    context.store.set(client, PRBM, prbm)
    context.store.set(client, CONSENSUS, consensus)
    evaluated = method.pre_local_init(client, received, 1)
    result = run_hook(context, method.local_train(client, evaluated, received, 2))

    expected, expected_prbm, _ = independent_training(
        context.architecture,
        received,
        prbm,
        consensus,
        tiny_federation.clients[client],
        derive_seed(0, 2, client, "local_training"),
        kappa=5.0,
        mu=0.3,
        lr=0.1,
    )
    assert set(result.upload) == set(received)  # the model only: the PRBM stays
    for key, value in expected.items():
        torch.testing.assert_close(result.upload[key], value)
    torch.testing.assert_close(context.store.get(client, PRBM), expected_prbm)
    torch.testing.assert_close(result.params, folded_head(result.upload, expected_prbm))
    assert not torch.equal(expected_prbm, prbm)


def test_kappa_zero_leaves_the_consensus_without_effect(tiny_federation):
    client, model = 1, build_model("mlp", (8,), 3, hidden_sizes=[16])
    runs = []
    for consensus in (torch.zeros(16), torch.full((16,), 7.0)):
        method, context = make_method(tiny_federation, model=model, kappa=0.0)
        context.store.set(client, CONSENSUS, consensus)
        received = method.global_params
        runs.append(run_hook(context, method.local_train(client, received, received, 1)))
    for key in runs[0].upload:
        assert torch.equal(runs[0].upload[key], runs[1].upload[key])


def test_initialization_period_forms_the_consensus_once_and_counts_it_both_ways(tiny_federation):
    method, context = make_method(tiny_federation)
    initial = {k: v.clone() for k, v in method.global_params.items()}
    loop = run_loop(method, context)

    # Every client trained a copy of the initial model on the cross-entropy alone; the consensus is the
    # sample-weighted mean of their final running means.
    means = []
    for i, data in enumerate(tiny_federation.clients):
        seed = derive_seed(0, 0, i, "initialization")
        _, _, mean = independent_training(
            context.architecture, initial, torch.zeros(16), None, data, seed, kappa=5.0, mu=0.3, lr=0.1
        )
        means.append(mean)
        torch.testing.assert_close(context.store.get(i, LOCAL_MEAN), mean)
    expected = sum(n * m for n, m in zip((10, 20, 30, 40), means)) / 100
    torch.testing.assert_close(method.consensus, expected)
    for i in range(4):
        assert context.store.get(i, CONSENSUS) is method.consensus  # never updated after round 0

    # Round 0 evaluates the initial model (the trained copies are discarded; every PRBM is still 0).
    first = loop.history[0].metrics
    n_model = numel(initial)
    assert first["params_sent"] == 4 * (n_model + 16)  # the model and the consensus to each client
    assert first["params_received"] == 4 * 16  # each client's mean
    assert first["bytes_received"] == 4 * 16 * 4
    last = loop.history[-1].metrics
    assert last["params_sent"] == 4 * n_model and last["params_received"] == 4 * n_model  # no PRBM travels


def test_prbm_stays_in_the_store_and_personalizes_the_evaluated_model(tiny_federation):
    method, context = make_method(tiny_federation)
    loop = run_loop(method, context)
    assert loop.history[-1].metrics["feddbe_consensus_norm"] == pytest.approx(float(method.consensus.norm()))
    prbms = [context.store.get(i, PRBM) for i in range(4)]
    assert not torch.equal(prbms[0], prbms[1])  # each client its own
    for i, prbm in enumerate(prbms):
        message = method.server_message(i, 2)
        assert PRBM not in message and all(not k.startswith("feddbe") for k in message)
        evaluated = context.store.get(i, "model")
        torch.testing.assert_close(evaluated["head.bias"], message["head.bias"] + message["head.weight"] @ prbm)
        assert torch.equal(evaluated["body.1.weight"], message["body.1.weight"])
    assert method.global_model(2) is method.global_params


def test_a_model_whose_head_is_not_one_linear_layer_is_refused(tiny_federation):
    with pytest.raises(ConfigError, match="head must be one nn.Linear layer"):
        make_method(tiny_federation, model=nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3)))


def test_momentum_is_refused(tiny_federation):
    with pytest.raises(ConfigError, match="federation.momentum"):
        make_method(tiny_federation, momentum=0.9)


def test_feddbe_has_no_ala_and_checks_its_keys():
    with pytest.raises(ConfigError, match="Unknown config key 'method.ala'"):
        load_config(ROOT / "configs" / "feddbe.yaml", ["method.ala.s=50"])
    with pytest.raises(ConfigError, match="method.mu"):
        load_config(ROOT / "configs" / "feddbe.yaml", ["method.mu=0"])
    cfg = load_config(ROOT / "configs" / "feddbe.yaml")
    assert (cfg.method.kappa, cfg.method.mu) == (50.0, 0.1)
