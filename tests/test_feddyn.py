"""FedDyn: the regularizer's gradient, the local step, the gradient state and the server's step by hand, the client
loop against an independent one, PFLlib's unsquared penalty in lock-step, the state kept across rounds, ALA."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad

from plfl.batches import batch_loader
from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.executors import VectorizedExecutor, drive
from plfl.executors.options import ClientWorkOptions, Vectorized
from plfl.methods import build_method
from plfl.methods.ala import ALAConfig
from plfl.methods.base import nbytes
from plfl.methods.feddyn import (
    FedDyn,
    FedDynConfig,
    FedDynStep,
    dynamic_regularizer,
    gradient_update,
    server_update,
)
from plfl.sections import FederationConfig, TrainerConfig
from plfl.seeding import derive_seed
from plfl.tasks import Batch, resolved

from conftest import ROOT, make_context, run_hook, run_loop, sequential

CONFIG = ROOT / "configs" / "feddyn.yaml"


def make_method(data, federation=None, **keys):
    context, model = make_context(data, **{"lr": 0.1, "batch_size": 5, **(federation or {})})
    return FedDyn(FedDynConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_regularizer_and_its_gradient_by_hand():
    # θ = (1, 2), θ^{t−1} = (0, 1), ∇L_i(θ_i^{t−1}) = (0.5, −1), α = 2:
    # value −⟨g, θ⟩ + α/2‖θ − θ^{t−1}‖² = 1.5 + 2 = 3.5; gradient −g + α(θ − θ^{t−1}) = (1.5, 3).
    theta, anchor, g = ({"w": torch.tensor(v)} for v in ([1.0, 2.0], [0.0, 1.0], [0.5, -1.0]))
    assert dynamic_regularizer(theta, anchor, g, 2.0).item() == pytest.approx(3.5)
    torch.testing.assert_close(grad(dynamic_regularizer)(theta, anchor, g, 2.0)["w"], torch.tensor([1.5, 3.0]))
    # PFLlib's unsquared α/2‖θ − θ^{t−1}‖ = √2, gradient −g + α/2 (θ − θ^{t−1})/‖θ − θ^{t−1}‖ = −g + (1, 1)/√2;
    # at θ = θ^{t−1} (every round's first step) the norm's gradient is 0, not NaN.
    assert dynamic_regularizer(theta, anchor, g, 2.0, squared=False).item() == pytest.approx(1.5 + math.sqrt(2))
    unsquared = grad(dynamic_regularizer)(theta, anchor, g, 2.0, False)["w"]
    torch.testing.assert_close(unsquared, torch.tensor([-0.5, 1.0]) + 1 / math.sqrt(2))
    torch.testing.assert_close(grad(dynamic_regularizer)(anchor, anchor, g, 2.0, False)["w"], -g["w"])


def test_one_local_step_of_a_linear_model_by_hand():
    # logits = x w, w (1, 2) = 0, one sample x = 1 of class 0: ∇CE = (−½, ½), CE = ln 2. With θ^{t−1} = (1, −1),
    # ∇L_i(θ_i^{t−1}) = (0.2, 0.4), α = 0.5: ∇ = (−½, ½) − (0.2, 0.4) + 0.5 (−1, 1) = (−1.2, 0.6);
    # η = 0.1: w = (0.12, −0.06). The loss returned is the cross-entropy alone.
    def network(state, x, mask=None, module=""):
        return x @ state["w"], {}

    step = FedDynStep(("w",), alpha=0.5, lr=0.1, squared=True)
    out = step(
        network,
        {"w": torch.zeros(1, 2)},
        {"grad/w": torch.tensor([[0.2, 0.4]])},
        {"anchor/w": torch.tensor([[1.0, -1.0]])},
        Batch(torch.ones(1, 1), torch.tensor([0]), None),
    )
    torch.testing.assert_close(out.state["w"], torch.tensor([[0.12, -0.06]]))
    assert out.loss.item() == pytest.approx(math.log(2)) and out.samples == 1


def test_gradient_state_and_server_step_by_hand():
    # ∇L_i(θ_i^t) = g − α(θ_i^t − θ^{t−1}) = (0.5, −1) − 2 (1, 1) = (−1.5, −3).
    new = gradient_update(
        {"w": torch.tensor([0.5, -1.0])}, {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.0, 1.0])}, 2.0
    )
    torch.testing.assert_close(new["w"], torch.tensor([-1.5, -3.0]))
    # Two clients, θ^{t−1} = (1, 2), h = (0.5, 0), α = 2, m = 4: Σ(θ_i − θ^{t−1}) = (1, 0) + (−1, 2) = (0, 2),
    # h = (0.5, 0) − 2/4 (0, 2) = (0.5, −1); θ = mean (1, 3) − h/2 = (0.75, 3.5). Buffers: the float one's
    # mean, the integer one the first upload's.
    previous = {"w": torch.tensor([1.0, 2.0]), "mean": torch.tensor([0.0]), "count": torch.tensor(1)}
    uploads = [
        {"w": torch.tensor([2.0, 2.0]), "mean": torch.tensor([1.0]), "count": torch.tensor(5)},
        {"w": torch.tensor([0.0, 4.0]), "mean": torch.tensor([3.0]), "count": torch.tensor(8)},
    ]
    theta, h = server_update(previous, {"w": torch.tensor([0.5, 0.0])}, uploads, alpha=2.0, num_clients=4)
    torch.testing.assert_close(h["w"], torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(theta["w"], torch.tensor([0.75, 3.5]))
    torch.testing.assert_close(theta["mean"], torch.tensor([2.0]))
    assert theta["count"].item() == 5 and set(h) == {"w"}
    with pytest.raises(ValueError, match="at least one upload"):
        server_update(previous, h, [], 2.0, 4)


def test_client_loop_matches_an_independent_one(tiny_federation):
    lr, alpha, client = 0.1, 0.5, 1  # client 1: 20 samples, 4 batches of 5 per epoch, 2 epochs
    method, context = make_method(tiny_federation, {"local_epochs": 2, "lr": lr}, alpha=alpha)
    g = torch.Generator().manual_seed(3)
    old = {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in method.h.items()}
    context.store.set(client, "feddyn_grad", old)
    message = method.server_message(client, 2)
    start = {k: v + 0.01 for k, v in message.items()}  # a start other than θ^{t−1}, as ALA's would be
    result = run_hook(context, method.local_train(client, start, message, 3))

    data = tiny_federation.clients[client]
    theta = {k: t.clone() for k, t in start.items()}
    loader = batch_loader(data.x_train, data.y_train, 5, derive_seed(0, 3, client, "local_training"))
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            leaves = {k: t.requires_grad_() for k, t in theta.items()}
            loss = F.cross_entropy(functional_call(context.architecture, leaves, (x,)), y)
            loss = loss - sum((old[k] * t).sum() for k, t in leaves.items())
            loss = loss + alpha / 2 * sum((t - message[k]).square().sum() for k, t in leaves.items())
            grads = torch.autograd.grad(loss, list(leaves.values()))
            with torch.no_grad():
                theta = {k: t - lr * gr for (k, t), gr in zip(leaves.items(), grads)}
    for k in message:
        torch.testing.assert_close(result.params[k], theta[k])
    assert result.samples_seen == 2 * data.num_train

    upload = method.client_message(client, result, 3)
    assert upload is result.params and nbytes(upload) == nbytes(message) == nbytes(method.global_params)
    for k, v in context.store.get(client, "feddyn_grad").items():  # ∇L_i(θ_i^t) = g − α(θ_i^t − θ^{t−1})
        torch.testing.assert_close(v, old[k] - alpha * (theta[k] - message[k]))


def test_unsquared_penalty_runs_in_lock_step_as_sequentially(tiny_federation):
    method, context = make_method(tiny_federation, {"batch_size": 7}, penalty="unsquared")
    federation = FederationConfig(**{**vars(context.federation), "executor": "vectorized"})
    work = ClientWorkOptions(federation, TrainerConfig(), False)
    vectorized = VectorizedExecutor(
        tiny_federation, context.architecture, work, Vectorized(), torch.device("cpu"), sequential(context)
    )
    message = method.server_message(0, 0)

    def hooks():
        return [resolved(method.local_train(i, dict(message), message, 1)) for i in range(4)]

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="federation.executor=vectorized")  # no fallback
        stacked = drive(hooks(), vectorized)
    for one, other in zip(stacked, drive(hooks(), sequential(context))):
        for k, v in other.params.items():
            torch.testing.assert_close(one.params[k], v, atol=1e-6, rtol=0)
        assert not torch.equal(one.params["head.weight"], message["head.weight"])


def test_server_state_is_the_mean_of_the_clients_gradients(tiny_federation):
    # 2 of 4 clients a round for 3 rounds: h moves by −α/m Σ(θ_i − θ^{t−1}) while each sampled ∇L_i moves by
    # −α(θ_i − θ^{t−1}), both from 0, so h = (1/m) Σ_i ∇L_i after every round (zeros for a client never sampled).
    method, context = make_method(tiny_federation, {"rounds": 3, "join_ratio": 0.5}, alpha=0.3)
    loop = run_loop(method, context)
    stored = [context.store.get(i, "feddyn_grad") for i in range(4)]
    assert sum(s is not None for s in stored) >= 2
    for k, h in method.h.items():
        torch.testing.assert_close(h, sum(s[k] for s in stored if s is not None) / 4)
        assert h.abs().sum() > 0
    last = loop.history[-1].metrics
    assert last["bytes_sent"] == 4 * nbytes(method.global_params)  # one model to every client
    assert last["bytes_received"] == 2 * nbytes(method.global_params)  # one from each of the 2 sampled
    assert set(method.state_dict()) == {"global_params", "h"}


def test_ala_composes_and_bad_options_are_refused(tiny_federation):
    cfg = load_config(CONFIG, ["method.ala.s=50"])
    assert cfg.method.ala.s == 50 and cfg.method.alpha == 1.0 and cfg.method.penalty == "squared"
    context, model = make_context(tiny_federation, rounds=2)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    config = FedDynConfig(name="feddyn", ala=ALAConfig(s=100, threshold=10.0, num_pre_loss=2))
    run_loop(build_method(config, context, initial), context)
    assert context.store.get(0, "ala_weights") is not None and context.store.get(0, "feddyn_grad") is not None

    with pytest.raises(ConfigError, match="method.penalty"):
        load_config(CONFIG, ["method.penalty=cubed"])
    with pytest.raises(ConfigError, match=r"Config key 'method.alpha' must be a number > 0; got 0.0."):
        load_config(CONFIG, ["method.alpha=0"])
    moving, _ = make_context(tiny_federation, momentum=0.5)
    with pytest.raises(ConfigError, match="federation.momentum"):
        FedDyn(FedDynConfig(), moving, initial)
