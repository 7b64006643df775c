"""ALA (FedALA, Eq. 3–5): hand-computed weight update, bounds, lower layers, skip and cap; on other
methods it changes only their local initialisation."""

import math
import warnings

import pytest
import torch
from torch import nn

from plfl.data import ClientData, FederatedData
from plfl.errors import PlflWarning
from plfl.methods import build_method, method_class, methods, takes_ala
from plfl.methods.ala import ALAConfig, local_aggregation
from plfl.models import BodyHeadModel
from plfl.tasks import resolved

from conftest import make_context, run_hook


def params_of(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ala(
    config: ALAConfig,
    model: nn.Module,
    global_params: dict,
    local_params: dict,
    weights,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
) -> tuple:
    """ALA of one client holding (x, y), its old model ``local_params`` and W_i ``weights`` (None: the initial
    stage), receiving ``global_params``, on the sequential executor: (θ̂, W_i, epochs)."""
    data = FederatedData(
        "one", [ClientData(x, y, x[:1], y[:1])], num_classes=max(2, int(y.max()) + 1), input_shape=tuple(x.shape[1:])
    )
    context, _ = make_context(data, model=model, batch_size=batch_size)
    if weights is not None:
        context.store.set(0, "ala_weights", weights)
    params = run_hook(context, local_aggregation(config, context, 0, global_params, local_params, round_=1))
    return params, context.store.get(0, "ala_weights"), context.store.get(0, "ala_epochs")


def test_one_weight_update_matches_hand_computation():
    """A 1→2 linear model without bias, one sample x=1 of class 0, W_i = 1 (after the initial stage)."""
    global_params = {"weight": torch.tensor([[-1.0], [1.0]])}
    local_params = {"weight": torch.tensor([[0.0], [0.0]])}
    params, weights, epochs = ala(
        ALAConfig(s=100, p=1, eta=0.5),
        nn.Linear(1, 2, bias=False),
        global_params,
        local_params,
        {"weight": torch.ones(2, 1)},
        torch.ones(1, 1),
        torch.tensor([0]),
        1,
    )
    # θ̂ = Θ_i + (Θ − Θ_i)·1 = [-1, 1]ᵀ; logits [-1, 1]; softmax p = [1/(1+e²), e²/(1+e²)].
    p0 = 1 / (1 + math.e**2)
    grad = torch.tensor([[p0 - 1], [1 - p0]])  # ∂CE/∂θ̂ for y = 0, x = 1
    gap = torch.tensor([[-1.0], [1.0]])  # Θ − Θ_i
    expected_w = torch.clamp(1 - 0.5 * grad * gap, 0, 1)  # both entries 1 − 0.5·0.8808 = 0.5596
    assert torch.allclose(weights["weight"], expected_w, atol=1e-6)
    assert weights["weight"][0, 0].item() == pytest.approx(0.55960, abs=1e-4)
    # The client starts from the recomputed θ̂ = Θ_i + (Θ − Θ_i) ⊙ W.
    assert torch.allclose(params["weight"], gap * expected_w, atol=1e-6)
    assert epochs == 1  # after the initial stage: exactly one epoch


def test_weights_stay_in_unit_interval_and_lower_tensors_equal_global():
    torch.manual_seed(0)

    def make():
        return BodyHeadModel(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Linear(8, 3))

    global_params, local_params = params_of(make()), params_of(make())
    x, y = torch.randn(50, 4), torch.randint(0, 3, (50,))
    config = ALAConfig(s=80, p=2, eta=50.0, num_pre_loss=2, max_init_epochs=5)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="ALA's initial stage")  # whether it settles is beside the point
        params, weights, _ = ala(config, make(), global_params, local_params, None, x, y, 5)
    assert set(weights) == {"head.weight", "head.bias"}
    for w in weights.values():
        assert w.min() >= 0 and w.max() <= 1
    assert any(((w > 0) & (w < 1)).any() for w in weights.values())  # learned, not just clamped
    for key in ("body.0.weight", "body.0.bias"):
        assert torch.equal(params[key], global_params[key])
    assert not torch.equal(params["head.weight"], global_params["head.weight"])


@pytest.mark.parametrize("batch_norm", [False, True])
def test_head_only_weights_learned_on_the_body_features_equal_those_of_the_whole_model(batch_norm):
    """With every top tensor in the head, ALA steps on the global body's features computed once; the same network
    as a plain Sequential (no body/head split) runs the whole model every batch: the same W_i and θ̂."""
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(8)] if batch_norm else []
    body, head = nn.Sequential(nn.Linear(4, 8), *norm, nn.ReLU()), nn.Linear(8, 3)
    split, whole = BodyHeadModel(body, head), nn.Sequential(body, head)
    global_params, local_params = params_of(split), {k: v + 0.3 for k, v in params_of(split).items()}
    x, y = torch.randn(23, 4), torch.randint(0, 3, (23,))  # batches of 5: a last one of 3

    def renamed(params):  # BodyHeadModel's names → the Sequential's ("body.0.weight" → "0.0.weight", ...)
        return {k.replace("body.", "0.", 1).replace("head.", "1.", 1): v for k, v in params.items()}

    config = ALAConfig(s=100, p=2, eta=5.0, num_pre_loss=2, max_init_epochs=6)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="ALA's initial stage")
        params, weights, epochs = ala(config, split, global_params, local_params, None, x, y, 5)
        expected = ala(config, whole, renamed(global_params), renamed(local_params), None, x, y, 5)
    assert epochs == expected[2]
    assert all(((w > 0) & (w < 1)).any() for w in weights.values())  # learned, not just clamped
    for got, want in ((params, expected[0]), (weights, expected[1])):
        assert renamed(got).keys() == want.keys()
        for name, value in renamed(got).items():
            torch.testing.assert_close(value, want[name], atol=1e-6, rtol=0)


def test_initial_stage_cap_stops_a_non_converging_case_with_a_warning():
    # More losses are needed (num_pre_loss + 1) than the cap allows: it can never settle.
    config = ALAConfig(s=100, p=2, num_pre_loss=10, max_init_epochs=4)
    g, loc = params_of(nn.Linear(3, 2)), params_of(nn.Linear(3, 2))
    with pytest.warns(PlflWarning, match=r"client 0 stopped at method.max_init_epochs=4"):
        _, _, epochs = ala(config, nn.Linear(3, 2), g, loc, None, torch.randn(8, 3), torch.randint(0, 2, (8,)), 4)
    assert epochs == 4


def test_initial_stage_runs_until_losses_settle():
    config = ALAConfig(s=100, p=2, num_pre_loss=3, threshold=10.0)
    g, loc = params_of(nn.Linear(3, 2)), params_of(nn.Linear(3, 2))
    _, _, epochs = ala(config, nn.Linear(3, 2), g, loc, None, torch.randn(8, 3), torch.randint(0, 2, (8,)), 4)
    assert epochs == 4  # needs more than num_pre_loss losses; a huge threshold settles at once


# Every method whose config takes method.ala: later methods join automatically.
ALA_METHODS = sorted(name for name, cls in methods().items() if takes_ala(cls))


@pytest.mark.parametrize("name", ALA_METHODS)
def test_ala_changes_the_local_initialisation_and_nothing_else(tiny_federation, name):
    """FedALA paper, Table 4: ALA replaces only the local initialisation of the method it is added to."""

    def make(ala):
        torch.manual_seed(0)  # the same initial model for both
        context, model = make_context(tiny_federation)
        config = method_class(name).config_class(name=name, ala=ala)
        return build_method(config, context, {k: v.clone() for k, v in model.state_dict().items()})

    # All 4 tensors of the MLP (a method may keep its head local, e.g. PartialFed); a huge threshold: the initial
    # stage settles at once.
    ala = ALAConfig(s=100, p=4, threshold=10.0, num_pre_loss=2)
    plain, with_ala = make(None), make(ala)
    clients = range(len(tiny_federation.clients))

    def broadcast(method, round_):
        for i in clients:
            init = method.pre_local_init(i, method.server_message(i, round_), round_)
            method.store.set(i, "model", run_hook(method.context, init))

    def train_and_aggregate(method, round_, starts):
        def update(i):
            received = method.server_message(i, round_ - 1)  # what the last broadcast sent
            result = yield from resolved(method.local_train(i, starts[i], received, round_))
            return (yield from resolved(method.post_train(i, result, round_)))

        results = {i: run_hook(method.context, update(i)) for i in clients}
        messages = {i: method.client_message(i, results[i], round_) for i in clients}
        for i in clients:
            method.store.set(i, "model", results[i].params)  # as the loop keeps them
        method.aggregate(messages, round_)
        return messages

    # Round 0 (ALA is skipped at a client's first initialisation) and round 1: identical.
    broadcast(plain, 0)
    broadcast(with_ala, 0)
    train_and_aggregate(plain, 1, {i: plain.store.get(i, "model") for i in clients})
    train_and_aggregate(with_ala, 1, {i: with_ala.store.get(i, "model") for i in clients})
    assert all(torch.equal(with_ala.global_params[k], v) for k, v in plain.global_params.items())
    # Round 1's broadcast: ALA's initialisation differs from the received model, the plain one does not.
    broadcast(plain, 1)
    broadcast(with_ala, 1)
    for i in clients:
        # The received model: the message's model keys (SCAFFOLD's message also carries its control variate).
        init = with_ala.store.get(i, "model")
        received = {k: v for k, v in with_ala.server_message(i, 1).items() if k in init}
        assert all(torch.equal(plain.store.get(i, "model")[k], v) for k, v in received.items())
        assert not all(torch.equal(init[k], v) for k, v in received.items()), i
    # Round 2 from ALA's initialisations: training, upload and aggregation are the same with or without ALA.
    starts = {i: with_ala.store.get(i, "model") for i in clients}
    uploads = [train_and_aggregate(method, 2, starts) for method in (plain, with_ala)]
    for i in clients:
        assert all(torch.equal(uploads[1][i][k], v) for k, v in uploads[0][i].items())
    assert all(torch.equal(with_ala.global_params[k], v) for k, v in plain.global_params.items())
