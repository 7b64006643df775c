"""pFedMe: the K inner steps and the local step by hand, the client loop against an independent one,
the server's β mix, BatchNorm statistics, and an end-to-end run (momentum and data.augment are refused:
test_bad_input.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value

from plfl.batches import batch_loader
from plfl.config import FederationConfig
from plfl.experiment import run_experiment
from plfl.methods.fedavg import FedAvg, FedAvgConfig
from plfl.methods.pfedme import PFedMe, PFedMeConfig, beta_mix, inner_solution, local_update
from plfl.seeding import derive_seed

from conftest import last_metrics, make_context, run_hook


def make_method(data, federation=None, **keys):
    context, model = make_context(data, **{"lr": 0.1, "batch_size": 5, **(federation or {})})
    return PFedMe(PFedMeConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_inner_steps_and_local_update_match_hand_computation():
    # f(θ) = ½‖θ − a‖², ∇f = θ − a; a = (1, −2), θ_0 = w = 0, λ = 1, lr_p = 0.1, K = 2.
    # Step 1: θ = −0.1 (−a) = (0.1, −0.2). Step 2: θ − 0.1 ((θ − a) + θ) = 0.8 θ + 0.1 a = (0.18, −0.36).
    a = torch.tensor([1.0, -2.0])

    def grad_fn(theta, buffers):  # no buffers to update: they pass through
        grads, value = grad_and_value(lambda t: 0.5 * (t["p"] - a).square().sum())(theta)
        return grads, value, buffers

    zero = {"p": torch.zeros(2)}
    theta, loss, buffers = inner_solution(grad_fn, zero, zero, {}, lam=1.0, lr=0.1, steps=2)
    torch.testing.assert_close(theta["p"], torch.tensor([0.18, -0.36]))
    assert loss.item() == pytest.approx((2.5 + 0.5 * (0.9**2 + 1.8**2)) / 2)  # f(θ_0), f(θ_1)
    # w ← w − η λ (w − θ) from w = (1, 1): η λ = 1 lands on θ; η λ = 0.5 halfway, ((1, 1) + θ) / 2.
    torch.testing.assert_close(local_update({"p": torch.ones(2)}, theta, lam=2.0, lr=0.5)["p"], theta["p"])
    torch.testing.assert_close(
        local_update({"p": torch.ones(2)}, theta, lam=1.0, lr=0.5)["p"], torch.tensor([0.59, 0.32])
    )


def test_client_loop_matches_an_independent_one(tiny_federation):
    lam, k, plr, lr, client = 2.0, 3, 0.05, 0.1, 1  # client 1: 20 samples, 4 batches of 5, 2 epochs
    method, context = make_method(tiny_federation, {"local_epochs": 2}, lam=lam, k=k, personal_lr=plr)
    global_params = method.global_params
    message = method.server_message(client, 2)  # the broadcast before round 3
    result = run_hook(context, method.local_train(client, context.store.get(client, "model"), message, 3))

    data = tiny_federation.clients[client]
    w = {key: t.clone() for key, t in global_params.items()}
    theta = {key: t.clone() for key, t in global_params.items()}
    loader = batch_loader(data.x_train, data.y_train, 5, derive_seed(0, 3, client, "local_training"))
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            for _ in range(k):
                leaves = {key: t.requires_grad_() for key, t in theta.items()}
                loss = F.cross_entropy(functional_call(context.architecture, leaves, (x,)), y)
                grads = torch.autograd.grad(loss, list(leaves.values()))
                with torch.no_grad():
                    theta = {key: t - plr * (g + lam * (t - w[key])) for (key, t), g in zip(leaves.items(), grads)}
            w = {key: t - lr * lam * (t - theta[key]) for key, t in w.items()}
    for key in global_params:
        torch.testing.assert_close(result.params[key], theta[key])  # θ: kept and evaluated
        torch.testing.assert_close(result.upload[key], w[key])  # w: uploaded
    assert result.samples_seen == 2 * data.num_train
    assert all(torch.equal(method.global_params[key], t) for key, t in global_params.items())  # Θ untouched
    context.store.set(client, "model", result.params)  # as the loop stores it
    assert run_hook(context, method.pre_local_init(client, method.server_message(client, 3), 3)) is result.params


def test_server_mixes_by_beta_and_beta_one_is_fedavgs_average(tiny_federation):
    previous = {"w": torch.tensor([1.0, 4.0]), "n": torch.tensor(2)}
    average = {"w": torch.tensor([3.0, 0.0]), "n": torch.tensor(5)}
    mixed = beta_mix(previous, average, 0.5)
    assert torch.equal(mixed["w"], torch.tensor([2.0, 2.0])) and mixed["n"].item() == 5
    assert torch.equal(beta_mix(previous, average, 2.0)["w"], torch.tensor([5.0, -4.0]))  # β > 1 extrapolates

    pfedme, context = make_method(tiny_federation, beta=1.0)
    fedavg = FedAvg(FedAvgConfig(), context, dict(pfedme.global_params))
    messages = {i: {key: t + 0.1 * (i + 1) for key, t in pfedme.global_params.items()} for i in (0, 2, 3)}
    pfedme.aggregate(messages, round_=1)
    fedavg.aggregate(messages, round_=1)
    assert all(torch.equal(pfedme.global_params[key], t) for key, t in fedavg.global_params.items())


def test_batchnorm_statistics_stay_with_the_client_and_keys_keep_their_order(tiny_federation):
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    context, _ = make_context(tiny_federation, model=model, batch_size=5, lr=FederationConfig().lr)  # default lr
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    method = PFedMe(PFedMeConfig(), context, {k: v.clone() for k, v in initial.items()})
    result = run_hook(context, method.local_train(2, initial, method.server_message(2, 0), 1))
    assert all(torch.equal(method.global_params[k], v) for k, v in initial.items())  # Θ's statistics untouched
    assert list(result.params) == list(result.upload) == list(initial)
    assert not torch.equal(result.params["1.running_mean"], initial["1.running_mean"])
    assert result.params["1.num_batches_tracked"].item() == 6 * 5  # 6 batches × K = 5 inner steps


@pytest.mark.slow
def test_pfedme_config_runs_end_to_end(digits_config):
    run_dir, summary = run_experiment(digits_config(**{"method.name": "pfedme", "method.beta": 2.0}))
    last = last_metrics(run_dir)
    assert float(last["accuracy"]) > 0.3  # 10 classes: chance is 0.1 (measured 0.46 at β = 1)
    assert float(last["bytes_received"]) == float(last["bytes_sent"])  # all 5 clients upload w, one model each
