"""FedCP: the MMD and the Gumbel draws by hand, the client loop against an independent autograd one, the conditional
input, what is sent and to whom, the aggregation, the evaluated ensemble on both executors, and its keys."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plfl.batches import batch_loader
from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.executors.lockstep import stack
from plfl.methods import fedcp as fedcp_module
from plfl.methods.base import nbytes, numel
from plfl.methods.fedcp import (
    CONTEXT,
    CPN,
    EVAL_SEED,
    GLOBAL,
    FedCP,
    FedCPConfig,
    FedCPForward,
    gumbel_from_bits,
    gumbel_noise,
    mmd,
    policy,
)
from plfl.seeding import derive_seed
from plfl.tasks import EvalTask

from conftest import ROOT, make_context, run_hook, run_loop, sequential

CONFIG = ROOT / "configs" / "fedcp.yaml"


def make_method(data, federation=None, **keys):
    context, model = make_context(data, **{"lr": 0.1, "batch_size": 5, **(federation or {})})
    return FedCP(FedCPConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_mmd_matches_hand_computation():
    # x = {(0, 0), (1, 0)}, y = {(0, 0), (0, 2)}: squared distances xx: 0, 1; yy: 0, 4; xy: (0,0)-(0,0) 0,
    # (0,0)-(0,2) 4, (1,0)-(0,0) 1, (1,0)-(0,2) 5. k(d) = Σ_σ exp(−d/(2σ)).
    x, y = torch.tensor([[0.0, 0.0], [1.0, 0.0]]), torch.tensor([[0.0, 0.0], [0.0, 2.0]])

    def k(d):
        return sum(math.exp(-d / (2 * s)) for s in (10, 15, 20, 50))

    kxx = (2 * k(0) + 2 * k(1)) / 4
    kyy = (2 * k(0) + 2 * k(4)) / 4
    kxy = (k(0) + k(4) + k(1) + k(5)) / 4
    assert mmd(x, y).item() == pytest.approx(kxx + kyy - 2 * kxy, rel=1e-6)
    assert mmd(x, x).item() == pytest.approx(0.0, abs=1e-6)
    # A padded row (mask 0) counts in no pair: the same value as without it.
    padded_x, padded_y = torch.cat([x, torch.full((1, 2), 9.0)]), torch.cat([y, torch.full((1, 2), -3.0)])
    mask = torch.tensor([1.0, 1.0, 0.0])
    assert mmd(padded_x, padded_y, mask).item() == pytest.approx(mmd(x, y).item(), rel=1e-6)


def test_gumbel_noise_is_keyed_by_row_and_column_not_by_batch():
    key = torch.tensor(12345)
    whole = gumbel_noise(key, torch.arange(300), 64)
    part = gumbel_noise(key, torch.arange(100, 130), 64)
    assert torch.equal(whole[100:130], part)  # the same sample, the same draws in any batch
    assert not torch.equal(gumbel_noise(torch.tensor(12346), torch.arange(300), 64), whole)
    assert torch.isfinite(whole).all()
    # Standard Gumbel: mean γ ≈ 0.5772, variance π²/6 ≈ 1.645 (19 200 draws: standard errors 0.01, 0.03).
    assert whole.mean().item() == pytest.approx(0.5772, abs=0.04)
    assert whole.var().item() == pytest.approx(math.pi**2 / 6, abs=0.12)


def test_gumbel_draws_are_finite_at_the_extreme_hashes():
    # u = (k + ½)/2^23 for the top 23 bits k: 2^-24 and 1 − 2^-24 at the ends, both exact in float32, so no draw is
    # ±inf (a 24-bit grid would round its last u to 1.0 and draw +inf, a NaN policy).
    h = torch.tensor([0, 2**32 - 1])
    draws = gumbel_from_bits(h)
    assert torch.isfinite(draws).all()
    expected = [-math.log(-math.log(2**-24)), -math.log(-math.log1p(-(2**-24)))]
    torch.testing.assert_close(draws, torch.tensor(expected), rtol=1e-4, atol=0)


def test_policy_splits_every_dimension_in_two():
    logits = torch.tensor([[[0.0, 2.0], [1.0, 2.0]]])  # (1, 2, 2): personal (0, 2), global (1, 2)
    r, s = policy(logits, None, tau=1.0)
    torch.testing.assert_close(r, torch.tensor([[1 / (1 + math.e), 0.5]]))
    torch.testing.assert_close(r + s, torch.ones(1, 2))
    noise = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])  # +1 to the first personal logit: 1 − 1 = 0 → r = 1/2
    r, _ = policy(logits, noise, tau=2.0)
    torch.testing.assert_close(r, torch.tensor([[0.5, 0.5]]))


def perturbed(params, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in params.items()}


def test_client_loop_matches_an_independent_autograd_one(tiny_federation, monkeypatch):
    lam, tau, lr, client, round_ = 2.0, 0.7, 0.1, 1, 3  # client 1: 20 samples, 4 batches of 5
    method, context = make_method(tiny_federation, lam=lam, tau=tau)
    received = perturbed(method.global_params, 0.2, 1)
    start = {**perturbed(method.initial_model(client), 0.1, 2), **{k: received[k] for k in method.body_keys}}
    start[CONTEXT] = torch.randn(16, generator=torch.Generator().manual_seed(5))
    draws = []

    def recorded(*args):
        draws.append(gumbel_noise(*args))
        return draws[-1]

    monkeypatch.setattr(fedcp_module, "gumbel_noise", recorded)
    result = run_hook(context, method.local_train(client, start, received, round_))

    def module(params):
        net = copy.deepcopy(context.architecture)
        net.load_state_dict({k: params[k] for k in net.state_dict()})
        return net

    local, glob = module(start), module({**start, **{k: received[k] for k in method.body_keys}})
    head_g = nn.Linear(16, 3)
    head_g.load_state_dict({"weight": start[GLOBAL + "head.weight"], "bias": start[GLOBAL + "head.bias"]})
    cpn = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU())
    cpn.load_state_dict(dict(zip(("0.weight", "0.bias", "1.weight", "1.bias"), (start[k] for k in CPN))))
    condition = start[CONTEXT] / start[CONTEXT].norm()
    trained = list(local.parameters()) + list(cpn.parameters())

    def reference_mmd(x, y):
        def kernel(a, b):
            d = torch.cdist(a, b).square()
            return sum(torch.exp(-d / (2 * s)) for s in (10, 15, 20, 50))

        return (kernel(x, x) + kernel(y, y) - 2 * kernel(x, y)).mean()

    data = tiny_federation.clients[client]
    batches = list(batch_loader(data.x_train, data.y_train, 5, derive_seed(0, round_, client, "local_training")))
    assert len(draws) == len(batches) == 4
    for (x, y), g in zip(batches, draws):
        z = local.body(x)
        weights = torch.softmax((cpn(z * condition).view(len(x), 2, 16) + g.view(len(x), 2, 16)) / tau, dim=1)
        logits = local.head(z * weights[:, 0]) + head_g(z * weights[:, 1])
        loss = F.cross_entropy(logits, y) + lam * reference_mmd(z, glob.body(x).detach())
        grads = torch.autograd.grad(loss, trained)
        with torch.no_grad():
            for p, grad in zip(trained, grads):
                p -= lr * grad
    for key, value in local.state_dict().items():
        torch.testing.assert_close(result.params[key], value)
    for key, value in zip(CPN, cpn.parameters()):
        torch.testing.assert_close(result.params[key], value)
    # The global head is frozen; the client's copy becomes ½ h^p + ½ h^g, which it uploads with f and the CPN.
    for key in ("head.weight", "head.bias"):
        torch.testing.assert_close(result.params[GLOBAL + key], 0.5 * result.params[key] + 0.5 * start[GLOBAL + key])
    assert torch.equal(result.params[CONTEXT], start[CONTEXT])
    assert result.upload.keys() == method.global_params.keys()
    assert all(result.upload[k] is result.params[k] for k in result.upload)
    # The draws differ from step to step and are the run's: the same training again gives the same model.
    assert not torch.equal(draws[0], draws[1])
    again = run_hook(context, method.local_train(client, start, received, round_))
    assert all(torch.equal(again.params[k], v) for k, v in result.params.items())


def test_what_is_sent_to_whom_and_the_conditional_input(tiny_federation):
    method, context = make_method(tiny_federation, {"join_ratio": 0.5})
    body = {k: method.global_params[k] for k in method.body_keys}
    # Round 0: everything to every client; each keeps its own uniform draw of v.
    assert all(method.server_message(c, 0) is method.global_params for c in range(4))
    models = [method.pre_local_init(c, method.server_message(c, 0), 0) for c in range(4)]
    assert all(torch.equal(m[CONTEXT], method.initial_model(c)[CONTEXT]) for c, m in enumerate(models))
    assert not torch.equal(models[0][CONTEXT], models[1][CONTEXT])
    assert ((models[0][CONTEXT] >= 0) & (models[0][CONTEXT] < 1)).all()
    # Round 1: clients 0 and 2 upload; they get the global head and CPN, the others the feature extractor alone.
    uploads = {}
    for c in (0, 2):
        context.store.set(c, "model", models[c])
        result = run_hook(context, method.local_train(c, models[c], method.server_message(c, 0), 1))
        context.store.set(c, "model", result.params)
        uploads[c] = method.client_message(c, result, 1)
    method.aggregate(uploads, 1)
    n0, n2 = (tiny_federation.clients[c].num_train for c in (0, 2))
    for key, value in method.global_params.items():
        torch.testing.assert_close(value, (n0 * uploads[0][key] + n2 * uploads[2][key]) / (n0 + n2))
    assert method.server_message(0, 1).keys() == method.global_params.keys()
    assert method.server_message(1, 1).keys() == body.keys()
    assert numel(method.server_message(1, 1)) == numel(body)
    assert numel(method.server_message(2, 1)) == numel(uploads[2])
    # A round later without an aggregation, nobody gets the head and CPN again.
    assert method.server_message(0, 2).keys() == body.keys()
    # A receiver's v is the sum of its trained personalized head's weight rows; the others keep theirs.
    after = method.pre_local_init(0, method.server_message(0, 1), 1)
    torch.testing.assert_close(after[CONTEXT], context.store.get(0, "model")["head.weight"].sum(0))
    assert torch.equal(after[GLOBAL + "head.weight"], method.global_params[GLOBAL + "head.weight"])
    context.store.set(1, "model", models[1])
    kept = method.pre_local_init(1, method.server_message(1, 1), 1)
    assert torch.equal(kept[CONTEXT], models[1][CONTEXT])
    assert torch.equal(kept["body.1.weight"], method.global_params["body.1.weight"])
    assert torch.equal(kept[GLOBAL + "head.weight"], models[1][GLOBAL + "head.weight"])


def test_a_run_counts_what_it_sends(tiny_federation):
    method, context = make_method(tiny_federation, {"rounds": 2})
    loop = run_loop(method, context)
    everything = nbytes(method.global_params)
    for row in loop.history[1:]:  # full participation: all three modules each way, to and from every client
        assert row.metrics["bytes_sent"] == row.metrics["bytes_received"] == 4 * everything
    assert loop.history[0].metrics["bytes_sent"] == 4 * everything
    assert 0 <= loop.history[-1].metrics["accuracy"] <= 1


def test_the_evaluated_model_is_the_ensemble_on_every_executor(tiny_federation):
    method, context = make_method(tiny_federation)
    client = 2
    model = perturbed(method.pre_local_init(client, method.server_message(client, 0), 0), 0.3, 7)
    data = tiny_federation.clients[client]
    for evaluation in ("gumbel", "softmax"):
        forward = FedCPForward(method.head_keys, 0.7, evaluation == "gumbel")
        result = sequential(context).evaluate([EvalTask(client, model, forward=forward)])[0]
        # By hand: f, the CPN on z ⊙ v̂, the policy with the sample's draws (keyed by its index), the two heads.
        net = copy.deepcopy(context.architecture)
        net.load_state_dict({k: model[k] for k in net.state_dict()})
        with torch.no_grad():
            z = net.body(data.x_test)
            hidden = F.linear(z * F.normalize(model[CONTEXT], dim=0), model[CPN[0]], model[CPN[1]])
            a = F.relu(F.layer_norm(hidden, (32,), model[CPN[2]], model[CPN[3]])).view(-1, 2, 16)
            if evaluation == "gumbel":
                a = a + gumbel_noise(model[EVAL_SEED], torch.arange(len(z)), 32).view(-1, 2, 16)
            w = torch.softmax(a / 0.7, dim=1)
            logits = net.head(z * w[:, 0]) + F.linear(
                z * w[:, 1], model[GLOBAL + "head.weight"], model[GLOBAL + "head.bias"]
            )
        assert result.correct == int((logits.argmax(1) == data.y_test).sum())
        assert result.loss == pytest.approx(F.cross_entropy(logits, data.y_test).item(), rel=1e-5)
    # The vectorized executor's vmap of the forward (two clients in one cohort) gives the same results.
    from plfl.executors import build_executor
    from plfl.executors.options import ClientWorkOptions, Vectorized
    from plfl.sections import TrainerConfig

    work = ClientWorkOptions(context.federation, TrainerConfig(), False)
    vectorized = build_executor(work, Vectorized(), tiny_federation, context.architecture)
    forward = method.prediction()
    other = perturbed(model, 0.1, 8)
    tasks = [EvalTask(client, model, forward=forward), EvalTask(0, other, forward=forward)]
    expected = sequential(context).evaluate(tasks)
    got = vectorized.evaluate(tasks)
    assert [(r.correct, r.total) for r in got] == [(r.correct, r.total) for r in expected]
    assert [r.loss for r in got] == pytest.approx([r.loss for r in expected], rel=1e-5)
    assert stack([model, other], torch.device("cpu")).keys() == model.keys()


def test_keys_are_checked_and_momentum_is_refused(tiny_federation):
    cfg = load_config(CONFIG, [])
    assert (cfg.method.lam, cfg.method.tau, cfg.method.evaluation) == (1.0, 1.0, "gumbel")
    with pytest.raises(ConfigError, match=r"Config key 'method.tau' must be a number > 0; got 0.0."):
        load_config(CONFIG, ["method.tau=0"])
    with pytest.raises(ConfigError, match=r"Config key 'method.lam' must be a number >= 0; got -1.0."):
        load_config(CONFIG, ["method.lam=-1"])
    with pytest.raises(ConfigError, match="method.evaluation"):
        load_config(CONFIG, ["method.evaluation=hard"])
    with pytest.raises(ConfigError, match="fedcp takes plain gradient steps"):
        make_method(tiny_federation, {"momentum": 0.5})
