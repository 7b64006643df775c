"""SCAFFOLD: the corrected step and option II's control variate by hand, the client loop against an independent
one, the server's step on two clients, what travels each way, c_i kept in the store across rounds, ALA."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from plfl.batches import batch_loader
from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.methods import build_method
from plfl.methods.ala import ALAConfig
from plfl.methods.base import nbytes
from plfl.methods.scaffold import (
    STEPS,
    Scaffold,
    ScaffoldConfig,
    ScaffoldStep,
    control_delta,
    corrected_step,
    server_update,
)
from plfl.seeding import derive_seed
from plfl.tasks import Batch

from conftest import ROOT, make_context, run_hook, run_loop


def make_method(data, federation=None, **keys):
    context, model = make_context(data, **{"lr": 0.1, "batch_size": 5, **(federation or {})})
    return Scaffold(ScaffoldConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_corrected_step_and_option_two_by_hand():
    # y ← y − η_l (g + c − c_i): y = (1, 2), g = (0.5, −1), c = (0.2, 0.2), c_i = (0.1, 0.4), η_l = 0.1
    # → y − 0.1 (0.6, −1.2) = (0.94, 2.12).
    y, g = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.5, -1.0])}
    c, c_i = {"w": torch.tensor([0.2, 0.2])}, {"w": torch.tensor([0.1, 0.4])}
    stepped = corrected_step(y, g, {"w": c["w"] - c_i["w"]}, lr=0.1)
    torch.testing.assert_close(stepped["w"], torch.tensor([0.94, 2.12]))
    # Option II with x = (1, 2), y_i = (0.8, 2.4) after K = 4 steps of η_l = 0.1: (x − y_i)/(K η_l) = (0.5, −1);
    # c_i⁺ = c_i − c + (0.5, −1) = (0.4, −0.8), Δc_i = c_i⁺ − c_i = (0.3, −1.2).
    x, trained = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.8, 2.4])}
    delta = control_delta(c, x, trained, steps=4, lr=0.1)
    torch.testing.assert_close(delta["w"], torch.tensor([0.3, -1.2]))
    torch.testing.assert_close(c_i["w"] + delta["w"], torch.tensor([0.4, -0.8]))
    assert torch.equal(control_delta(c, x, trained, steps=0, lr=0.1)["w"], torch.zeros(2))  # no step, no change


def test_one_step_of_a_linear_model_by_hand():
    # logits = x w, w (1, 2) = 0, one sample x = 1 of class 0: softmax (½, ½), ∇_w CE = x (p − e_0) = (−½, ½),
    # CE = ln 2. With c − c_i = (0.1, −0.2) and η_l = 0.1: w = −0.1 (−0.4, 0.3) = (0.04, −0.03); one step counted.
    def network(state, x, mask=None, module=""):
        return x @ state["w"], {}

    step = ScaffoldStep(("w",), lr=0.1)
    state = {"w": torch.zeros(1, 2), STEPS: torch.tensor(0)}
    inputs = {"control/w": torch.tensor([[0.1, -0.2]])}
    out = step(network, state, inputs, {}, Batch(torch.ones(1, 1), torch.tensor([0]), None))
    torch.testing.assert_close(out.state["w"], torch.tensor([[0.04, -0.03]]))
    assert out.state[STEPS].item() == 1 and out.samples == 1
    assert out.loss.item() == pytest.approx(math.log(2))


def test_client_loop_matches_an_independent_one(tiny_federation):
    lr, client = 0.1, 2  # client 2: 30 samples, batches of 7: 5 batches (the last of 2) per epoch, 2 epochs
    method, context = make_method(tiny_federation, {"local_epochs": 2, "batch_size": 7, "lr": lr})
    g = torch.Generator().manual_seed(1)
    method.server_c = {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in method.server_c.items()}
    own = {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in method.server_c.items()}
    context.store.set(client, "scaffold_c", own)
    message = method.server_message(client, 2)  # the broadcast before round 3
    x = method.pre_local_init(client, message, 2)
    assert list(x) == list(method.global_params)  # the model's keys only, in order
    result = run_hook(context, method.local_train(client, x, message, 3))

    data = tiny_federation.clients[client]
    y = {k: t.clone() for k, t in x.items()}
    loader = batch_loader(data.x_train, data.y_train, 7, derive_seed(0, 3, client, "local_training"))
    steps = 0
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        for inputs, labels in loader:
            leaves = {k: t.requires_grad_() for k, t in y.items()}
            loss = F.cross_entropy(functional_call(context.architecture, leaves, (inputs,)), labels)
            grads = torch.autograd.grad(loss, list(leaves.values()))
            with torch.no_grad():
                y = {k: t - lr * (gr + method.server_c[k] - own[k]) for (k, t), gr in zip(leaves.items(), grads)}
            steps += 1
    assert steps == 10 and result.samples_seen == 60
    for k in x:
        torch.testing.assert_close(result.params[k], y[k])
        torch.testing.assert_close(result.upload[f"delta/{k}"], y[k] - x[k])
        expected = own[k] - method.server_c[k] + (x[k] - y[k]) / (steps * lr)  # option II's c_i⁺
        torch.testing.assert_close(own[k] + result.upload[f"control/{k}"], expected)

    # Uploading commits c_i⁺ to the store; the message is the upload itself.
    assert method.client_message(client, result, 3) is result.upload
    for k, v in context.store.get(client, "scaffold_c").items():
        torch.testing.assert_close(v, own[k] + result.upload[f"control/{k}"])


def test_server_step_on_two_clients_by_hand():
    # x = (1, 2), η_g = 0.5, N = 4: Δy = (1, 0), (−3, 2) → mean (−1, 1) → x = (0.5, 2.5).
    # c = 0; Δc = (0.4, −0.8), (0.4, 0) → c = Σ/4 = (0.2, −0.2). The float buffer moves by its unscaled mean Δ
    # (2 + 4)/2 = 3; the integer one is the first upload's.
    x = {"w": torch.tensor([1.0, 2.0]), "mean": torch.tensor([1.0]), "count": torch.tensor(5)}
    c = {"w": torch.zeros(2)}
    deltas = [
        {"w": torch.tensor([1.0, 0.0]), "mean": torch.tensor([2.0]), "count": torch.tensor(7)},
        {"w": torch.tensor([-3.0, 2.0]), "mean": torch.tensor([4.0]), "count": torch.tensor(9)},
    ]
    control = [{"w": torch.tensor([0.4, -0.8])}, {"w": torch.tensor([0.4, 0.0])}]
    x, c = server_update(x, c, deltas, control, num_clients=4, server_lr=0.5)
    torch.testing.assert_close(x["w"], torch.tensor([0.5, 2.5]))
    torch.testing.assert_close(x["mean"], torch.tensor([4.0]))
    assert x["count"].item() == 7
    torch.testing.assert_close(c["w"], torch.tensor([0.2, -0.2]))
    with pytest.raises(ValueError, match="at least one upload"):
        server_update(x, c, [], [], 4, 1.0)


def test_what_is_sent_both_ways(tiny_federation):
    method, context = make_method(tiny_federation)
    names = [name for name, _ in context.architecture.named_parameters()]
    model_bytes = nbytes(method.global_params)  # the MLP has parameters only
    message = method.server_message(0, 0)
    assert set(message) == set(method.global_params) | {f"control/{k}" for k in names}
    assert nbytes(message) == 2 * model_bytes  # x and c
    x = method.pre_local_init(0, message, 0)
    result = run_hook(context, method.local_train(0, x, message, 1))
    upload = method.client_message(0, result, 1)
    assert set(upload) == {f"delta/{k}" for k in method.global_params} | {f"control/{k}" for k in names}
    assert nbytes(upload) == 2 * model_bytes  # Δy and Δc


def test_client_controls_persist_and_average_to_the_servers(tiny_federation):
    # 2 of 4 clients a round for 3 rounds: c starts at 0 and moves by Σ Δc_i / N while each c_i moves by its
    # Δc_i, so c = mean over all N clients of c_i (zeros for a client never sampled) after every round.
    method, context = make_method(tiny_federation, {"rounds": 3, "join_ratio": 0.5})
    loop = run_loop(method, context)
    stored = [context.store.get(i, "scaffold_c") for i in range(4)]
    assert sum(c is not None for c in stored) >= 2
    for k, c in method.server_c.items():
        total = sum(s[k] for s in stored if s is not None)
        torch.testing.assert_close(c, total / 4)
        assert c.abs().sum() > 0
    last = loop.history[-1].metrics
    assert last["bytes_sent"] == 4 * 2 * nbytes(method.global_params)  # every client gets x and c
    assert last["bytes_received"] == 2 * 2 * nbytes(method.global_params)  # the 2 sampled upload Δy and Δc
    assert set(method.state_dict()) == {"global_params", "server_c"}


def test_ala_composes_and_momentum_is_refused(tiny_federation):
    cfg = load_config(ROOT / "configs" / "scaffold.yaml", ["method.ala.s=50"])
    assert cfg.method.ala.s == 50 and cfg.method.server_lr == 1.0
    context, model = make_context(tiny_federation, rounds=2)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    config = ScaffoldConfig(name="scaffold", ala=ALAConfig(s=100, threshold=10.0, num_pre_loss=2))
    method = build_method(config, context, initial)
    run_loop(method, context)
    assert context.store.get(0, "ala_weights") is not None and context.store.get(0, "scaffold_c") is not None
    assert set(context.store.get(0, "model")) == set(initial)  # ALA's model: the model's keys only

    moving, _ = make_context(tiny_federation, momentum=0.5)
    with pytest.raises(ConfigError, match="federation.momentum"):
        Scaffold(ScaffoldConfig(), moving, initial)
