"""GPFL: the valve against its module, the conditional inputs and both guidance losses by hand, the client's steps
against an independent three-optimiser loop, what is sent and what stays, the conditional inputs' timing, the
modules' initialisation order, and the models GPFL refuses."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plfl.batches import batch_loader
from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.methods.base import numel
from plfl.methods.gpfl import (
    GPFL,
    GPFLConfig,
    angle_loss,
    conditional_inputs,
    magnitude_loss,
    valve_output,
)
from plfl.models import build_model
from plfl.models.networks import ConditionalValve, valved
from plfl.seeding import derive_seed

from conftest import ROOT, make_context, run_hook, run_loop


def make_method(data, lam=0.5, mu=0.2, **federation):
    model = valved(build_model("mlp", data.input_shape, data.num_classes, hidden_sizes=[16]))
    context, model = make_context(data, model=model, **federation)  # lr 0.1, batch size 5
    params = {k: v.clone() for k, v in model.state_dict().items()}
    return GPFL(GPFLConfig("gpfl", lam=lam, mu=mu), context, params), context


def randomized(module: nn.Module, seed: int) -> nn.Module:
    """``module`` with every parameter drawn afresh (LayerNorm's affine parameters away from 1 and 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


def test_valve_output_is_the_modules_forward_and_the_model_runs_the_valve_under_its_condition():
    valve = randomized(ConditionalValve(6), 0)
    features, condition = torch.randn(4, 6), torch.randn(6)
    expected = torch.relu(features * (valve.gamma(condition) + 1) + valve.beta(condition))
    torch.testing.assert_close(valve(features, condition), expected)
    torch.testing.assert_close(valve_output(valve.state_dict(), features, condition), expected)

    model = randomized(valved(build_model("mlp", (8,), 3, hidden_sizes=[6])), 1)
    x = torch.randn(5, 8)
    body = model.body
    torch.testing.assert_close(model(x), model.head(body.valve(body.backbone(x), body.condition)))


def test_conditional_inputs_are_the_mean_and_the_frequency_weighted_sum_of_the_embeddings():
    table = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    g, p = conditional_inputs(table, torch.tensor([0.5, 0.5, 0.0]))
    torch.testing.assert_close(g, torch.tensor([4 / 3, 5 / 3]))
    torch.testing.assert_close(p, torch.tensor([0.5, 1.0]))


def test_angle_loss_is_the_cross_entropy_of_unscaled_cosines_and_ignores_padding():
    table = torch.tensor([[2.0, 0.0], [0.0, 5.0]])
    features = torch.tensor([[3.0, 0.0], [1.0, 1.0]])
    # Row 0: cosines (1, 0), y = 0 → log(1 + e^−1). Row 1: cosines (1/√2, 1/√2), y = 1 → log 2.
    both = angle_loss(features, table, torch.tensor([0, 1]))
    assert both.item() == pytest.approx((math.log(1 + math.exp(-1)) + math.log(2)) / 2)
    padded = angle_loss(features, table, torch.tensor([0, 1]), torch.tensor([1.0, 0.0]))
    assert padded.item() == pytest.approx(math.log(1 + math.exp(-1)))


def test_magnitude_loss_is_one_norm_over_the_whole_batch_and_ignores_padding():
    features = torch.tensor([[3.0, 1.0], [1.0, 4.0], [9.0, 9.0]])
    targets = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    assert magnitude_loss(features[:2], targets[:2]).item() == pytest.approx(5.0)  # √(3² + 4²), not 3 + 4
    assert magnitude_loss(features, targets, torch.tensor([1.0, 1.0, 0.0])).item() == pytest.approx(5.0)


def test_client_steps_match_an_independent_three_optimiser_loop(tiny_federation):
    client, lr, lam, mu = 2, 0.1, 0.5, 0.2  # 30 samples, 6 batches of 5
    method, context = make_method(tiny_federation, lam=lam, mu=mu)
    randomized(context.architecture, 3)  # LayerNorm affine parameters away from 1 and 0 (the start is from here)
    start = {k: v.clone() for k, v in context.architecture.state_dict().items()}
    received = method.shared(start)
    context.store.set(client, "model", start)  # its own head: the randomized one
    g = torch.Generator().manual_seed(4)
    own_table = torch.randn(3, 16, generator=g)
    context.store.set(client, "gpfl_table", own_table)  # the table the client trained last round
    params = method.pre_local_init(client, received, 1)
    result = run_hook(context, method.local_train(client, params, received, 2))

    # The conditional inputs from the client's own table, its class frequencies over all its training samples.
    data = tiny_federation.clients[client]
    alpha = torch.bincount(data.y_train, minlength=3).float() / len(data.y_train)
    generic, personal = own_table.mean(0), alpha @ own_table
    torch.testing.assert_close(params["body.condition"], personal)

    # The authors' loop: the model (extractor and head), the GCE and the CoV each with an SGD optimiser, the last
    # two with weight decay μ; the magnitude-level targets from the received table, fixed.
    model = copy.deepcopy(context.architecture)
    model.load_state_dict(start)
    model.body.condition.copy_(personal)
    backbone, valve, head, gce = model.body.backbone, model.body.valve, model.head, model.embedding
    frozen = gce.weight.detach().clone()
    optimizers = [
        torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=lr),
        torch.optim.SGD(gce.parameters(), lr=lr, weight_decay=mu),
        torch.optim.SGD(valve.parameters(), lr=lr, weight_decay=mu),
    ]
    for x, y in batch_loader(data.x_train, data.y_train, 5, derive_seed(0, 2, client, "local_training")):
        features = backbone(x)
        logits = head(valve(features, personal))
        shared = valve(features, generic)
        cosines = F.normalize(shared) @ F.normalize(gce.weight).T
        loss = F.cross_entropy(logits, y) + F.cross_entropy(cosines, y) + lam * torch.norm(shared - frozen[y], 2)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(result.params[key], value, atol=1e-6, rtol=1e-5)


def test_extractor_valve_and_embeddings_travel_the_head_and_conditions_stay(tiny_federation):
    method, context = make_method(tiny_federation, rounds=2)
    shared = method.shared(method.initial_params)
    assert not any(k.startswith("head.") or k == "body.condition" for k in shared)
    assert {"embedding.weight", "body.valve.gamma.0.weight", "body.backbone.1.weight"} <= set(shared)
    # Round 0: no table held yet, so both conditional inputs are zero.
    model = method.pre_local_init(0, method.global_params, 0)
    assert torch.equal(model["body.condition"], torch.zeros(16))
    assert torch.equal(context.store.get(0, "gpfl_global_condition"), torch.zeros(16))

    loop = run_loop(method, context)
    last = loop.history[-1].metrics
    assert last["params_sent"] == 4 * numel(shared)  # to every client
    assert last["params_received"] == 4 * numel(shared)  # from every client (join ratio 1)
    for i in range(4):
        stored = context.store.get(i, "model")
        message = method.server_message(i, 2)
        assert "head.weight" not in message and "body.condition" not in message
        for key in shared:
            assert torch.equal(stored[key], message[key])  # the received φ, CoV and GCE
        # After the last broadcast the client holds the received table; its conditions came from its trained one.
        assert torch.equal(context.store.get(i, "gpfl_table"), message["embedding.weight"])
        assert not torch.equal(stored["body.condition"], torch.zeros(16))
    heads = [context.store.get(i, "model")["head.weight"] for i in range(4)]
    assert not torch.equal(heads[0], heads[1])  # each client its own head


def test_conditional_inputs_come_from_the_table_the_client_trained(tiny_federation):
    method, context = make_method(tiny_federation)
    message = method.global_params
    method.pre_local_init(1, message, 0)
    result = run_hook(context, method.local_train(1, method.pre_local_init(1, message, 0), message, 1))
    method.client_message(1, result, 1)
    trained = result.params["embedding.weight"]
    assert not torch.equal(trained, message["embedding.weight"])
    new_global = {k: v + 1 for k, v in message.items()}
    model = method.pre_local_init(1, new_global, 1)
    alpha = torch.bincount(tiny_federation.clients[1].y_train, minlength=3).float() / 20
    torch.testing.assert_close(model["body.condition"], alpha @ trained)
    torch.testing.assert_close(context.store.get(1, "gpfl_global_condition"), trained.mean(0))
    assert torch.equal(model["embedding.weight"], new_global["embedding.weight"])


def test_the_embedding_table_and_the_valve_are_drawn_after_the_network_in_the_authors_order():
    torch.manual_seed(5)
    model = valved(build_model("cnn", (1, 28, 28), 10))
    torch.manual_seed(5)
    build_model("cnn", (1, 28, 28), 10)
    embedding = nn.Embedding(10, 512)
    gamma = nn.Linear(512, 512)
    nn.LayerNorm(512)
    beta = nn.Linear(512, 512)
    assert torch.equal(model.embedding.weight, embedding.weight)
    assert torch.equal(model.body.valve.gamma[0].weight, gamma.weight)
    assert torch.equal(model.body.valve.beta[0].bias, beta.bias)


def test_a_model_without_a_valve_or_without_a_linear_head_is_refused(tiny_federation):
    context, model = make_context(tiny_federation)
    with pytest.raises(ConfigError, match="conditional valve"):
        GPFL(GPFLConfig("gpfl"), context, model.state_dict())
    with pytest.raises(ConfigError, match="nn.Linear head"):
        GPFL.client_network(nn.Sequential(nn.Linear(8, 3)))


def test_gpfl_has_no_ala_and_its_config_has_the_authors_defaults():
    cfg = load_config(ROOT / "configs" / "gpfl.yaml")
    assert (cfg.method.lam, cfg.method.mu) == (0.01, 0.1)
    assert (GPFLConfig().lam, GPFLConfig().mu) == (0.01, 0.1)
    with pytest.raises(ConfigError, match="Unknown config key 'method.ala'"):
        load_config(ROOT / "configs" / "gpfl.yaml", ["method.ala.s=50"])
