"""PartialFed: Fix keeps exactly the named layers local; Adaptive's learned strategy loads a layer that helps from
the global model and keeps one that hurts; its initialisation mixes layers by the strategy; keys checked."""

import pytest
import torch
from torch import nn

from plfl.data import ClientData, FederatedData
from plfl.errors import ConfigError
from plfl.experiment import run_experiment
from plfl.methods import build_method
from plfl.methods.ala import ALAConfig
from plfl.methods.partialfed import PREVIOUS, STRATEGY, PartialFed, PartialFedConfig, layer_keys, relaxed
from plfl.models import BodyHeadModel, build_model

from conftest import last_metrics, make_context, run_hook, run_loop


def make_method(data, model=None, **keys):
    context, model = make_context(data, model=model)
    method = build_method(
        PartialFedConfig(name="partialfed", **keys), context, {k: v.clone() for k, v in model.state_dict().items()}
    )
    return method, context


def test_fix_keeps_exactly_the_named_layers_local_batch_norm_statistics_included(tiny_federation):
    model = build_model(
        "mlp", tiny_federation.input_shape, tiny_federation.num_classes, hidden_sizes=[16], batch_norm=True
    )
    method, context = make_method(tiny_federation, model)  # the default: head and BatchNorm layers local
    local = {
        "head.weight",
        "head.bias",
        "body.2.weight",
        "body.2.bias",
        "body.2.running_mean",
        "body.2.running_var",
        "body.2.num_batches_tracked",
    }
    assert method.local_keys == local and local.isdisjoint(method.server_message(0, 0))
    loop = run_loop(method, context)
    own = [context.store.get(i, "model") for i in range(len(tiny_federation.clients))]
    for key in local - {"body.2.num_batches_tracked"}:  # never averaged: every client keeps its own values
        assert not torch.equal(own[0][key], own[1][key]), key
    for key, value in method.global_params.items():  # the rest is the global model everywhere
        assert all(torch.equal(client[key], value) for client in own)
    assert loop.history[-1].metrics["params_sent"] == 4 * sum(v.numel() for v in method.global_params.values())
    layer, _ = make_method(tiny_federation, local_layers=["body.1"])
    assert layer.local_keys == {"body.1.weight", "body.1.bias"}


def test_a_local_layer_that_is_no_module_is_refused_naming_the_modules(tiny_federation):
    with pytest.raises(
        ConfigError,
        match=r"method.local_layers names \['conv9'\], which are no modules of model; use "
        r"bn, or some of: body, body.0, body.1, body.2, head.",
    ):
        make_method(tiny_federation, local_layers=["conv9", "head"])


def test_fix_refuses_ala_that_would_only_touch_local_layers(tiny_federation):
    with pytest.raises(ConfigError, match=r"method.ala.p=2 lets ALA aggregate only tensors that method.local_layers"):
        make_method(tiny_federation, ala=ALAConfig(p=2))  # the MLP's top 2 tensors: the local head
    method, _ = make_method(tiny_federation, ala=ALAConfig(p=3))  # body.1.bias is loaded from the global model
    assert isinstance(method, PartialFed) and method.ala.p == 3


def test_keys_of_the_other_strategy_are_refused():
    with pytest.raises(ConfigError, match="method.strategy_lr is read only by method.strategy=adaptive"):
        PartialFedConfig(strategy_lr=3.0)
    with pytest.raises(ConfigError, match="method.local_layers is read only by method.strategy=fix"):
        PartialFedConfig(strategy="adaptive", local_layers=["head"])


def test_relaxed_choice_is_a_softmax_and_hard_choices_keep_its_gradient():
    beta, noise = torch.tensor([1.0, -1.0], requires_grad=True), torch.tensor([0.5, 0.0])
    soft = relaxed(beta, noise, tau=2.0, hard=False)
    torch.testing.assert_close(soft, torch.softmax(torch.tensor([1.5, -1.0]) / 2.0, -1))
    hard = relaxed(beta, noise, tau=2.0, hard=True)
    assert hard.tolist() == [1.0, 0.0]
    (g_soft,) = torch.autograd.grad(soft[0], beta)
    (g_hard,) = torch.autograd.grad(relaxed(beta, noise, tau=2.0, hard=True)[0], beta)
    torch.testing.assert_close(g_hard, g_soft)  # straight-through


@pytest.fixture
def one_client() -> tuple[FederatedData, BodyHeadModel, dict, dict]:
    """One client of 200 samples whose labels a linear model of a fixed body can fit, and two models: ``good``,
    trained on them, and ``bad``, the same body with a head that maps every class to another one."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    data = FederatedData("one", [ClientData(x, y, x[:40], y[:40])], num_classes=4, input_shape=(6,))
    torch.manual_seed(0)
    model = BodyHeadModel(nn.Sequential(nn.Linear(6, 16), nn.ReLU()), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(300):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    good = {k: v.detach().clone() for k, v in model.state_dict().items()}
    bad = {**good, "head.weight": good["head.weight"].roll(1, 0), "head.bias": good["head.bias"].roll(1, 0)}
    return data, model, good, bad


def test_adaptive_learns_to_load_a_helping_layer_and_keep_a_hurting_one(one_client):
    """The global model has the good body under a head that scrambles the classes; the client's own model has the
    good head on a noisy copy of that body: its strategy moves towards the global body and its own head."""
    data, model, good, bad = one_client
    torch.manual_seed(1)
    own = {k: v + torch.randn_like(v) * v.std() if k.startswith("body.") else v for k, v in good.items()}
    method, context = make_method(data, model, strategy="adaptive", warmup_rounds=0, tau0=1.0)
    context.federation.local_epochs = 5
    context.store.set(0, "model", own)  # θ^c_{t−1}
    start = method.pre_local_init(0, bad, round_=0)  # θ_t = bad
    assert torch.equal(context.store.get(0, PREVIOUS)["body.0.weight"], own["body.0.weight"])
    run_hook(context, method.local_train(0, start, bad, round_=1))
    beta = context.store.get(0, STRATEGY)
    assert set(beta) == {"body.0", "head"}
    probability = {layer: torch.softmax(b, -1)[0].item() for layer, b in beta.items()}  # of loading the global layer
    assert probability["body.0"] > 0.6 and probability["head"] < 0.4, probability  # measured 0.83 and 0.00


def test_adaptive_initialisation_mixes_each_layer_by_the_clients_strategy(one_client):
    data, model, good, bad = one_client
    method, context = make_method(data, model, strategy="adaptive", warmup_rounds=2, tau0=0.5, tau_decay=1.0)
    assert layer_keys(model) == {"body.0": ("body.0.weight", "body.0.bias"), "head": ("head.weight", "head.bias")}
    context.store.set(0, "model", good)
    warm_up = method.pre_local_init(0, bad, round_=1)  # before round warmup_rounds: the received model
    assert all(torch.equal(warm_up[k], v) for k, v in bad.items())
    context.store.set(0, STRATEGY, {"body.0": torch.tensor([30.0, 0.0]), "head": torch.tensor([0.0, 30.0])})
    init = method.pre_local_init(0, bad, round_=2)  # β so large that the noise barely matters: α ≈ one-hot
    torch.testing.assert_close(init["body.0.weight"], bad["body.0.weight"], atol=1e-5, rtol=0)  # loaded
    torch.testing.assert_close(init["head.weight"], good["head.weight"], atol=1e-5, rtol=0)  # kept


@pytest.mark.slow
def test_partialfed_config_runs_end_to_end_with_its_strategy_reported(digits_config):
    run_dir, summary = run_experiment(
        digits_config(**{"method.name": "partialfed", "method.strategy": "adaptive", "method.warmup_rounds": 1})
    )
    last = last_metrics(run_dir)
    assert summary["status"] == "completed" and float(last["accuracy"]) > 0.3  # 10 classes: chance is 0.1
    rows = (run_dir / "tables" / "partialfed_strategy.csv").read_text().splitlines()
    assert rows[0] == "round,layer,global_probability" and len(rows) == 1 + 3 * 2  # rounds 1-3, the 2 layers
    assert 0 < float(last["strategy_global_mean"]) < 1
