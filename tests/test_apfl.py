"""APFL: one step of w, v and α by hand, the mix, α's clipping, the client state kept across rounds, and the
upload of w alone (momentum and data.augment are refused as for every method with steps of its own)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from plfl.batches import batch_loader
from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.executors.steps import FunctionalNetwork
from plfl.methods.apfl import APFL, APFLConfig, APFLStep, apfl_update, mix
from plfl.methods.base import numel
from plfl.seeding import derive_seed
from plfl.tasks import Batch

from conftest import ROOT, make_context, run_hook, run_loop, sequential


def make_method(data, **keys):
    context, model = make_context(data, rounds=2)  # lr 0.1, batch size 5
    return APFL(APFLConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


@pytest.mark.parametrize("masked", [False, True])
def test_one_step_of_w_v_and_alpha_matches_hand_computation(masked):
    # A linear model z = W x with two classes, one sample x = 1 of class 0; η = η_α = 0.1, α = 0.5.
    # w = 0: z = (0, 0), ∇f(w) = p − e_0 = (−0.5, 0.5), so w' = (0.05, −0.05).
    # v = (2, 0): v̄ = (1, 0), z = (1, 0), p_1 = 1 / (1 + e), ∇f(v̄) = (−p_1, p_1);
    # v' = v − η α ∇f(v̄) = (2 + 0.05 p_1, −0.05 p_1); ∇_α = ⟨v − w, ∇f(v̄)⟩ = −2 p_1, α' = 0.5 + 0.2 p_1.
    p1 = 1 / (1 + math.e)
    network = FunctionalNetwork(nn.Linear(1, 2, bias=False), torch.device("cpu"))
    state = {"w/weight": torch.zeros(2, 1), "v/weight": torch.tensor([[2.0], [0.0]]), "alpha": torch.tensor(0.5)}
    batch = Batch(torch.ones(1, 1), torch.tensor([0]), torch.ones(1) if masked else None)
    out = APFLStep(("weight",), lr=0.1, alpha_lr=0.1)(network, state, {}, {}, batch)
    torch.testing.assert_close(out.state["w/weight"], torch.tensor([[0.05], [-0.05]]))
    torch.testing.assert_close(out.state["v/weight"], torch.tensor([[2 + 0.05 * p1], [-0.05 * p1]]))
    torch.testing.assert_close(out.state["alpha"], torch.tensor(0.5 + 0.2 * p1))
    assert out.loss.item() == pytest.approx(math.log(1 + math.exp(-1)))  # f(v̄) before the step
    assert torch.equal(state["w/weight"], torch.zeros(2, 1)) and state["alpha"].item() == 0.5  # not in place


def test_alpha_is_clipped_to_the_unit_interval():
    # ⟨v − w, ∇f(v̄)⟩ = 1·2 + 2·(−1) + ... chosen as ±4: a step of η_α = 1 from α = 0.5 leaves [0, 1].
    w, v = {"p": torch.zeros(2)}, {"p": torch.tensor([1.0, 2.0])}
    zero = {"p": torch.zeros(2)}
    for grad_mix, expected in (({"p": torch.tensor([2.0, 1.0])}, 0.0), ({"p": torch.tensor([-2.0, -1.0])}, 1.0)):
        new_w, new_v, alpha = apfl_update(w, v, torch.tensor(0.5), zero, grad_mix, lr=0.1, alpha_lr=1.0)
        assert alpha.item() == expected
        torch.testing.assert_close(new_v["p"], v["p"] - 0.05 * grad_mix["p"])  # η α ∇f(v̄) with the old α
    _, _, alpha = apfl_update(w, v, torch.tensor(0.5), zero, {"p": torch.tensor([0.1, 0.0])}, lr=0.1, alpha_lr=1.0)
    assert alpha.item() == pytest.approx(0.4)  # inside: no clipping


def test_mix_weighs_parameters_and_keeps_the_local_buffers():
    local = {"a": torch.tensor([1.0, 3.0]), "mean": torch.tensor([5.0]), "count": torch.tensor(7)}
    global_copy = {"a": torch.tensor([-1.0, 1.0]), "mean": torch.tensor([0.0]), "count": torch.tensor(2)}
    mixed = mix(local, global_copy, torch.tensor(0.25), ("a",))
    assert list(mixed) == list(local)
    torch.testing.assert_close(mixed["a"], torch.tensor([-0.5, 1.5]))  # 0.25 v + 0.75 w
    assert mixed["mean"] is local["mean"] and mixed["count"] is local["count"]


def reference_round(context, start_w, start_v, alpha, client, round_, lr):
    """Alg. 1 for one client and one epoch with torch.autograd, independent of the step: (w, v, α)."""
    data = context.data.clients[client]
    model = context.architecture
    w, v = dict(start_w), dict(start_v)
    for x, y in batch_loader(data.x_train, data.y_train, 5, derive_seed(0, round_, client, "local_training")):
        w_leaves = {k: t.detach().requires_grad_() for k, t in w.items()}
        loss = F.cross_entropy(functional_call(model, w_leaves, (x,)), y)
        grad_w = torch.autograd.grad(loss, list(w_leaves.values()))
        v_leaves = {k: t.detach().requires_grad_() for k, t in v.items()}
        a = alpha.detach().requires_grad_()
        mixed = {k: a * v_leaves[k] + (1 - a) * w[k] for k in v}
        grads = torch.autograd.grad(F.cross_entropy(functional_call(model, mixed, (x,)), y), [*v_leaves.values(), a])
        with torch.no_grad():
            w = {k: t - lr * g for (k, t), g in zip(w.items(), grad_w)}
            v = {k: t - lr * g for (k, t), g in zip(v.items(), grads[:-1])}
            alpha = torch.clamp(alpha - lr * grads[-1], 0, 1)
    return w, v, alpha


def test_client_keeps_v_and_alpha_across_rounds_and_uploads_w_alone(tiny_federation):
    client, lr = 1, 0.1  # 20 samples, 4 batches of 5
    method, context = make_method(tiny_federation, alpha=0.7)
    initial = method.global_params
    received = method.server_message(client, 0)
    assert torch.equal(method.pre_local_init(client, received, 0)["head.weight"], initial["head.weight"])

    first = run_hook(context, method.local_train(client, method.pre_local_init(client, received, 0), received, 1))
    w, v, alpha = reference_round(context, initial, initial, torch.tensor(0.7), client, 1, lr)
    stored_v, stored_alpha = context.store.get(client, "local_model"), context.store.get(client, "alpha")
    assert list(first.upload) == list(initial) == list(stored_v)  # w alone travels, in the model's names
    assert numel(method.client_message(client, first, 1)) == numel(initial)
    for key in initial:
        torch.testing.assert_close(first.upload[key], w[key])
        torch.testing.assert_close(stored_v[key], v[key])
    torch.testing.assert_close(stored_alpha, alpha)
    assert stored_alpha.item() != 0.7 and not torch.equal(stored_v["head.weight"], initial["head.weight"])
    torch.testing.assert_close(first.params["head.weight"], alpha * v["head.weight"] + (1 - alpha) * w["head.weight"])

    # The next broadcast mixes the kept v and α with the new global model; round 2 starts from them.
    new_global = {k: t + 0.05 for k, t in initial.items()}
    evaluated = method.pre_local_init(client, new_global, 1)
    torch.testing.assert_close(
        evaluated["head.weight"],
        stored_alpha * stored_v["head.weight"] + (1 - stored_alpha) * new_global["head.weight"],
    )
    second = run_hook(context, method.local_train(client, evaluated, new_global, 2))
    w, v, alpha = reference_round(context, new_global, stored_v, stored_alpha, client, 2, lr)
    for key in initial:
        torch.testing.assert_close(second.upload[key], w[key])
        torch.testing.assert_close(context.store.get(client, "local_model")[key], v[key])
    torch.testing.assert_close(context.store.get(client, "alpha"), alpha)
    assert method.round_metrics(2)["alpha_mean"] == pytest.approx((3 * 0.7 + alpha.item()) / 4)


def test_w_trains_as_plain_sgd_from_the_received_model(tiny_federation):
    # w's steps ignore v and α: FedAvg's local training (momentum 0) from the received model, same batches.
    method, context = make_method(tiny_federation)
    data, received = tiny_federation.clients[2], method.server_message(2, 0)
    result = run_hook(context, method.local_train(2, received, received, 1))
    fedavg = sequential(context).trainer.train(
        received, data.x_train, data.y_train, seed=derive_seed(0, 1, 2, "local_training"), epochs=1
    )
    for key, value in fedavg.params.items():
        torch.testing.assert_close(result.upload[key], value)


def test_federation_uploads_one_model_per_client_and_evaluates_the_mix(tiny_federation):
    method, context = make_method(tiny_federation)
    loop = run_loop(method, context)
    last = loop.history[-1].metrics
    assert last["params_received"] == 4 * numel(method.global_params)  # w only, from each of the 4 clients
    for client in range(4):
        local, alpha = context.store.get(client, "local_model"), context.store.get(client, "alpha")
        expected = mix(local, method.global_params, alpha, method.parameter_names)
        assert all(torch.equal(context.store.get(client, "model")[k], t) for k, t in expected.items())


def test_alpha_out_of_range_and_ala_are_refused():
    with pytest.raises(ConfigError, match=r"Config key 'method.alpha' must be a number in \[0, 1\]; got 1.5."):
        load_config(ROOT / "configs" / "apfl.yaml", ["method.alpha=1.5"])
    # v_i and α_i are the client's local initialisation; ALA's model would not be trained from (module docstring).
    with pytest.raises(ConfigError, match="Unknown config key 'method.ala'"):
        load_config(ROOT / "configs" / "apfl.yaml", ["method.ala.s=50"])
