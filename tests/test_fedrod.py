"""FedRoD: the balanced softmax loss by hand, the summed head, the client's steps against an independent loop, and
the personal head kept in the store and never sent (momentum and data.augment are refused as for every method with
steps of its own)."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from plfl.batches import batch_loader
from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.methods.base import MethodConfig, numel, require_linear_head
from plfl.methods.fedrod import FedRoD, balanced_softmax_loss, log_class_counts, summed_head
from plfl.models import build_model
from plfl.seeding import derive_seed

from conftest import ROOT, make_context, run_hook, run_loop


def make_method(data, model=None):
    context, model = make_context(data, model=model, rounds=2)  # lr 0.1, batch size 5
    return FedRoD(MethodConfig("fedrod"), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_balanced_softmax_loss_matches_hand_computation_with_an_absent_class():
    # Counts n = (2, 0, 1): class 1 drops out of the softmax. z = (1, 2, 0), y = 0:
    # −log(2e / (2e + 1)) = log(1 + 1 / (2e)).
    log_counts = log_class_counts(torch.tensor([0, 2, 0]), 3)
    assert log_counts[0].item() == pytest.approx(math.log(2)) and log_counts[2].item() == 0
    logits = torch.tensor([[1.0, 2.0, 0.0]])
    loss = balanced_softmax_loss(logits, torch.tensor([0]), log_counts)
    assert loss.item() == pytest.approx(math.log(1 + 1 / (2 * math.e)))
    # Plain cross-entropy would count class 1: −log(e / (e + e² + 1)).
    assert F.cross_entropy(logits, torch.tensor([0])).item() == pytest.approx(math.log(1 + math.e + 1 / math.e))

    # A padded row (mask 0) labelled with the absent class counts nothing and keeps the loss and gradient finite.
    both = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    padded = balanced_softmax_loss(both, torch.tensor([0, 1]), log_counts, torch.tensor([1.0, 0.0]))
    (grad,) = torch.autograd.grad(padded, both)
    assert padded.item() == pytest.approx(loss.item())
    assert torch.isfinite(grad).all() and torch.equal(grad[1], torch.zeros(3)) and grad[0, 1].item() == 0


def test_summed_head_gives_the_sum_of_both_heads_logits(tiny_federation):
    model = build_model("mlp", (8,), 3, hidden_sizes=[16], batch_norm=True).eval()
    params = model.state_dict()
    g = torch.Generator().manual_seed(3)
    personal = {k: torch.randn(params[k].shape, generator=g) for k in ("head.weight", "head.bias")}
    x = tiny_federation.clients[0].x_test
    features = model.body(x)
    expected = model.head(features) + F.linear(features, personal["head.weight"], personal["head.bias"])
    torch.testing.assert_close(functional_call(model, summed_head(params, personal), (x,)), expected)
    assert summed_head(params, personal)["body.2.running_mean"] is params["body.2.running_mean"]


def test_client_steps_match_an_independent_loop(tiny_federation):
    client, lr = 2, 0.1  # 30 samples, 6 batches of 5
    method, context = make_method(tiny_federation)
    received = {k: t + 0.01 for k, t in method.global_params.items()}
    g = torch.Generator().manual_seed(1)
    personal = {k: torch.randn(received[k].shape, generator=g) for k in ("head.weight", "head.bias")}
    context.store.set(client, "personal_head", personal)
    result = run_hook(context, method.local_train(client, method.pre_local_init(client, received, 1), received, 2))

    # PFLlib's loop: SGD of the model on the balanced softmax loss, then of the personal head on the detached
    # features' summed logits, both from the same forward pass.
    data = tiny_federation.clients[client]
    model = copy.deepcopy(context.architecture)
    model.load_state_dict(received)
    head = nn.Linear(16, 3)
    head.load_state_dict({k.removeprefix("head."): v for k, v in personal.items()})
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in (model, head)]
    counts = torch.bincount(data.y_train, minlength=3).float()
    for x, y in batch_loader(data.x_train, data.y_train, 5, derive_seed(0, 2, client, "local_training")):
        features = model.body(x)
        generic = model.head(features)
        for optimizer in optimizers:
            optimizer.zero_grad()
        F.cross_entropy(generic + counts.log(), y).backward()
        F.cross_entropy(generic.detach() + head(features.detach()), y).backward()
        for optimizer in optimizers:
            optimizer.step()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(result.upload[key], value)
    stored = context.store.get(client, "personal_head")
    assert set(stored) == {"head.weight", "head.bias"}
    torch.testing.assert_close(stored["head.weight"], head.weight.detach())
    torch.testing.assert_close(stored["head.bias"], head.bias.detach())
    torch.testing.assert_close(result.params["head.weight"], model.head.weight.detach() + head.weight.detach())


def test_personal_head_stays_in_the_store_and_never_travels(tiny_federation):
    method, context = make_method(tiny_federation)
    initial_head = method.global_params["head.weight"]
    assert torch.equal(method.pre_local_init(0, method.global_params, 0)["head.weight"], 2 * initial_head)
    loop = run_loop(method, context)
    last = loop.history[-1].metrics
    assert last["params_received"] == 4 * numel(method.global_params)  # body and generic head, once per client
    assert last["params_sent"] == 4 * numel(method.global_params)
    heads = [context.store.get(i, "personal_head") for i in range(4)]
    for i, head in enumerate(heads):
        message = method.server_message(i, 2)
        assert torch.equal(message["head.weight"], method.global_params["head.weight"])  # the generic head
        assert not torch.equal(head["head.weight"], message["head.weight"])
        evaluated = context.store.get(i, "model")
        assert torch.equal(evaluated["head.weight"], message["head.weight"] + head["head.weight"])
        assert torch.equal(evaluated["body.1.weight"], message["body.1.weight"])
    assert not torch.equal(heads[0]["head.weight"], heads[1]["head.weight"])  # each client its own


def test_a_model_whose_head_is_not_one_linear_layer_is_refused(tiny_federation):
    with pytest.raises(ConfigError, match="head must be one nn.Linear layer"):
        make_method(tiny_federation, model=nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3)))


def test_fedrod_has_no_ala():
    # The client trains from the received model and its stored personal head; ALA's model would go untrained.
    with pytest.raises(ConfigError, match="Unknown config key 'method.ala'"):
        load_config(ROOT / "configs" / "fedrod.yaml", ["method.ala.s=50"])


def test_a_model_without_one_linear_head_is_refused_by_name():
    """The methods that work on a body and one linear head refuse another model, naming its head and the fix."""
    body_head = build_model("mlp", (1, 8, 8), 10, hidden_sizes=[4])
    assert require_linear_head("fedrod", SimpleNamespace(architecture=body_head), "sums heads") is body_head.head
    two_layer_head = copy.deepcopy(body_head)
    two_layer_head.head = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 10))
    for architecture, head in (
        (nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), "NoneType"),
        (two_layer_head, "Sequential"),
    ):
        with pytest.raises(ConfigError) as error:
            require_linear_head("fedrod", SimpleNamespace(architecture=architecture), "sums heads")
        assert str(error.value) == (
            f"fedrod sums heads, so the model's head must be one nn.Linear layer; {type(architecture).__name__} has "
            f"{head} as its head. Choose a model of plfl.models."
        )
