"""MOON: ℓ_con by hand, the client loop against an independent autograd one, the previous model kept in the store
and used the next round, what is sent, and its keys and ALA (momentum and data.augment are refused as for every
method with its own steps)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from plfl.batches import batch_loader
from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.experiment import run_experiment
from plfl.methods.base import nbytes
from plfl.methods.moon import MOON, MOONConfig, contrastive_loss
from plfl.seeding import derive_seed

from conftest import ROOT, last_metrics, make_context, run_hook, run_loop

CONFIG = ROOT / "configs" / "moon.yaml"


def make_method(data, federation=None, **keys):
    context, model = make_context(data, **{"lr": 0.1, "batch_size": 5, **(federation or {})})
    return MOON(MOONConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_contrastive_loss_matches_hand_computation():
    # z = (1, 0), z_glob = (1, 0): s_g = 1; z_prev = (0, 1): s_p = 0. τ = 0.5:
    # ℓ = −log(e² / (e² + e⁰)) = log(1 + e⁻²).
    # Second row: z = (1, 1), z_glob = (1, 0): s_g = 1/√2; z_prev = (−1, −1): s_p = −1.
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    z_glob = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    z_prev = torch.tensor([[0.0, 1.0], [-1.0, -1.0]])
    got = contrastive_loss(z, z_glob, z_prev, tau=0.5)
    s_g, s_p = 1 / math.sqrt(2), -1.0
    expected = [
        -math.log(math.exp(2) / (math.exp(2) + 1)),
        -math.log(math.exp(s_g / 0.5) / (math.exp(s_g / 0.5) + math.exp(s_p / 0.5))),
    ]
    torch.testing.assert_close(got, torch.tensor(expected))
    assert got[0].item() == pytest.approx(math.log(1 + math.exp(-2)))
    # The global and the previous model agree: log 2 whatever z is (and no gradient).
    same = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(contrastive_loss(torch.randn(3, 4), same, same, 0.7), torch.full((3,), math.log(2)))


def perturbed(params, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in params.items()}


def test_client_loop_matches_an_independent_autograd_one(tiny_federation):
    mu, tau, lr, client, round_ = 2.0, 0.5, 0.1, 1, 3  # client 1: 20 samples, 4 batches of 5
    method, context = make_method(tiny_federation, mu=mu, tau=tau)
    received = perturbed(method.global_params, 0.2, 1)  # w^t
    start = perturbed(received, 0.1, 2)  # the client's initialised model (e.g. ALA's), not w^t itself
    previous = perturbed(received, 0.3, 3)
    context.store.set(client, "moon_previous", previous)
    result = run_hook(context, method.local_train(client, start, received, round_))

    def module(params):
        net = copy.deepcopy(context.architecture)
        net.load_state_dict(params)
        return net

    local, glob, prev = module(start), module(received), module(previous)
    data = tiny_federation.clients[client]
    for x, y in batch_loader(data.x_train, data.y_train, 5, derive_seed(0, round_, client, "local_training")):
        z = local.body(x)
        sim_g = F.cosine_similarity(z, glob.body(x).detach(), dim=1)
        sim_p = F.cosine_similarity(z, prev.body(x).detach(), dim=1)
        con = -torch.log(torch.exp(sim_g / tau) / (torch.exp(sim_g / tau) + torch.exp(sim_p / tau)))
        loss = F.cross_entropy(local.head(z), y) + mu * con.mean()
        grads = torch.autograd.grad(loss, list(local.parameters()))
        with torch.no_grad():
            for p, g in zip(local.parameters(), grads):
                p -= lr * g
    trained = local.state_dict()
    assert list(result.params) == list(start)
    for key in start:
        torch.testing.assert_close(result.params[key], trained[key])
    assert result.samples_seen == data.num_train
    # The frozen models are untouched, and μ = 0 is a different (plain cross-entropy) training.
    assert all(torch.equal(context.store.get(client, "moon_previous")[k], v) for k, v in previous.items())
    plain, plain_context = make_method(tiny_federation, mu=0.0)
    plain_context.store.set(client, "moon_previous", previous)
    other = run_hook(plain_context, plain.local_train(client, start, received, round_))
    assert not torch.equal(other.params["body.1.weight"], result.params["body.1.weight"])


def test_previous_model_is_the_initial_one_then_the_last_trained_one(tiny_federation):
    method, context = make_method(tiny_federation, {"rounds": 2})
    initial = {k: v.clone() for k, v in method.global_params.items()}
    assert all(torch.equal(method.previous_model(0)[k], v) for k, v in initial.items())  # before any training
    loop = run_loop(method, context)
    for client in range(len(tiny_federation.clients)):
        previous = context.store.get(client, "moon_previous")
        assert previous.keys() == initial.keys()
        # Round 2's upload is what the client keeps; its model after the broadcast is the new global one.
        assert not torch.equal(previous["head.weight"], initial["head.weight"])
        assert not torch.equal(previous["head.weight"], method.global_params["head.weight"])
        assert all(torch.equal(context.store.get(client, "model")[k], v) for k, v in method.global_params.items())
    size = nbytes(method.global_params)
    last = loop.history[-1].metrics
    assert last["bytes_sent"] == last["bytes_received"] == 4 * size  # one model each way, nothing more


def test_the_kept_model_is_what_the_next_round_contrasts_with(tiny_federation):
    # Round 2 of client 0 run from the store as the loop leaves it equals round 2 with that previous model given.
    method, context = make_method(tiny_federation)
    received = method.server_message(0, 0)
    first = run_hook(context, method.local_train(0, received, received, 1))
    upload = method.client_message(0, first, 1)
    assert upload is first.params and context.store.get(0, "moon_previous") is first.params
    second = run_hook(context, method.local_train(0, received, received, 2))
    again, again_context = make_method(tiny_federation)
    again_context.store.set(0, "moon_previous", {k: v.clone() for k, v in first.params.items()})
    expected = run_hook(again_context, again.local_train(0, received, received, 2))
    assert all(torch.equal(second.params[k], v) for k, v in expected.params.items())
    fresh, fresh_context = make_method(tiny_federation)  # with the initial model as the previous one instead
    unlike = run_hook(fresh_context, fresh.local_train(0, received, received, 2))
    assert not torch.equal(unlike.params["body.1.weight"], second.params["body.1.weight"])


def test_keys_are_checked_and_ala_composes():
    assert load_config(CONFIG, []).method.mu == 1.0
    with pytest.raises(ConfigError, match=r"Config key 'method.tau' must be a number > 0; got 0.0."):
        load_config(CONFIG, ["method.tau=0"])
    with pytest.raises(ConfigError, match=r"Config key 'method.mu' must be a number >= 0; got -1.0."):
        load_config(CONFIG, ["method.mu=-1"])
    assert load_config(CONFIG, ["method.ala.s=50"]).method.ala.s == 50


def test_momentum_is_refused(tiny_federation):
    with pytest.raises(ConfigError, match="moon takes plain gradient steps"):
        make_method(tiny_federation, {"momentum": 0.5})


@pytest.mark.slow
def test_moon_config_runs_end_to_end(digits_config):
    run_dir, _ = run_experiment(digits_config(**{"method.name": "moon", "federation.rounds": 5}))
    last = last_metrics(run_dir)
    assert float(last["accuracy"]) > 0.25  # 10 classes: chance is 0.1 (measured 0.36; FedAvg's 0.39)
    assert float(last["bytes_received"]) == float(last["bytes_sent"])  # one model each way
