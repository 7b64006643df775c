"""Self-FL: the Gaussian-model check, the step rule, online variances, aggregation and an end-to-end run."""

import csv
import math

import pytest
import torch

from plfl.data import ClientData, FederatedData
from plfl.errors import ConfigError
from plfl.executors import SequentialExecutor
from plfl.experiment import run_experiment
from plfl.methods.base import FederationContext
from plfl.methods.selffl import (
    SIGMA0_SQ,
    SIGMA_SQ,
    TOTAL_WEIGHT,
    SelfFL,
    SelfFLConfig,
    across_variance,
    leave_one_out,
    local_steps,
    loo_init,
    welford_update,
    welford_variance,
)
from plfl.sections import FederationConfig
from plfl.state import ClientStateStore
from plfl.tasks import TrainResult

from conftest import make_context, run_hook, sequential


class QuadraticTrainer:
    """Local training on the loss ½(θ − z)² of a scalar θ ("theta"), z the mean of a seeded
    bootstrap resample of the client's scalars ``x`` (Self-FL, Sec. 3.2: each round's
    local training as the optimisation on a bootstrapped sample); ``bootstrap=False``
    uses z = mean(x). An epoch is 40 gradient steps (converged at η = 0.5)."""

    def __init__(self, lr: float):
        self.lr = lr
        self.bootstrap = True

    def train(self, params, x, y, seed, epochs=None, steps=None, trainable=None, proximal=None):
        sample = x[torch.randint(len(x), (len(x),), generator=torch.Generator().manual_seed(seed))]
        z = sample.mean() if self.bootstrap else x.mean()
        theta = params["theta"].clone()
        for _ in range(steps if steps is not None else 40 * epochs):
            theta = theta - self.lr * (theta - z)
        return TrainResult({"theta": theta}, 0.0, len(x))


def fl_optimum(z: torch.Tensor, sigma_sq: torch.Tensor, sigma0_sq: float) -> torch.Tensor:
    """θ_m^(FL) of METHODS.md Eq. 3 (leave-one-out form) for all m; z, sigma_sq: (M,)."""
    w = 1 / (sigma0_sq + sigma_sq)
    w_others = w.sum() - w
    prior_mean = ((w * z).sum() - w * z) / w_others  # θ^(G)_{-m}
    prior_precision = 1 / (sigma0_sq + 1 / w_others)  # (σ_0² + v_{-m})⁻¹
    return (z / sigma_sq + prior_precision * prior_mean) / (1 / sigma_sq + prior_precision)


def gaussian_errors(seed: int, M=20, sigma0_sq=1.0, noise_sq=4.0, warmup=20, rounds=20, lr=0.5):
    """Squared errors against θ^(FL), summed over M clients, of Self-FL's personal estimates,
    the local-only estimates z_m and the FedAvg global model, on data drawn from Eq. 1.

    Client m holds n_m ~ U{2..49} scalars x ~ N(θ_m, noise_sq), θ_m ~ N(0, σ_0²); its local
    optimum is z_m = mean(x), σ_m² = noise_sq / n_m. Self-FL runs through its hooks in the
    federation loop's order; its personal estimate is one more local training from INIT_m on
    the full-data loss (a single bootstrap round would add noise of the size being measured). The quadratic
    trainer stands in for the sequential executor's LocalTrainer; the model has no architecture.
    """
    g = torch.Generator().manual_seed(seed)
    theta = sigma0_sq**0.5 * torch.randn(M, generator=g, dtype=torch.float64)
    n = torch.randint(2, 50, (M,), generator=g)
    xs = [theta[m] + noise_sq**0.5 * torch.randn(int(n[m]), generator=g, dtype=torch.float64) for m in range(M)]

    def labels(x):
        return torch.zeros(len(x), dtype=torch.long)  # unused by the quadratic loss

    clients = [ClientData(x, labels(x), x[:1], labels(x[:1])) for x in xs]
    data = FederatedData("gaussian", clients, num_classes=1, input_shape=())
    trainer = QuadraticTrainer(lr)
    executor = SequentialExecutor(data, trainer)
    context = FederationContext(data, ClientStateStore(M), FederationConfig(lr=lr, seed=seed), None)
    method = SelfFL(SelfFLConfig(warmup_rounds=warmup), context, {"theta": torch.zeros(1, dtype=torch.float64)})
    received = {}  # the last broadcast's message to each client, as the loop keeps them for local_train
    for round_ in range(warmup + rounds + 1):
        if round_ > 0:
            messages = {}
            for m in range(M):
                hook = method.local_train(m, context.store.get(m, "model"), received[m], round_)
                result = run_hook(context, hook, executor)
                context.store.set(m, "model", result.params)
                messages[m] = method.client_message(m, result, round_)
            method.aggregate(messages, round_)
        for m in range(M):
            received[m] = method.server_message(m, round_)
            context.store.set(m, "model", method.pre_local_init(m, received[m], round_))
    trainer.bootstrap = False
    personal = torch.cat(
        [
            run_hook(
                context, method.local_train(m, context.store.get(m, "model"), received[m], round_ + 1), executor
            ).params["theta"]
            for m in range(M)
        ]
    )
    z = torch.stack([x.mean() for x in xs])
    target = fl_optimum(z, noise_sq / n.double(), sigma0_sq)
    fedavg = (n * z).sum() / n.sum()  # FedAvg's fixed point with converged local training
    return [((estimate - target) ** 2).sum().item() for estimate in (personal, z, fedavg)]


def test_personal_estimates_approach_fl_optimum_on_gaussian_model():
    selffl, local, fedavg = map(sum, zip(*(gaussian_errors(seed) for seed in range(5))))
    # Closer than both baselines, by a margin: a rule that ignores the variances
    # (e.g. always l_max steps, i.e. local-only) or inverts them does not get below 0.7.
    assert selffl < 0.7 * local
    assert selffl < 0.7 * fedavg


def test_local_steps_rule():
    # σ_m² = 1, σ_0² + v = 3, η = 0.5: (1 − η)^l = 1/4 → l = 2 (Eq. 8).
    assert local_steps(1.0, 2.0, 1.0, 0.5) == 2
    assert local_steps(1.0, 2.5, 1.0, 0.5) == 3  # ratio 1/4.5: ⌈2.17⌉
    more_spread = [local_steps(1.0, s0, 0.1, 0.1) for s0 in (0.5, 1.0, 4.0)]
    noisier = [local_steps(s, 1.0, 0.1, 0.1) for s in (0.1, 1.0, 10.0)]
    assert more_spread == sorted(more_spread) and len(set(more_spread)) == 3
    assert noisier == sorted(noisier, reverse=True) and len(set(noisier)) == 3
    assert local_steps(1e-15, 1.0, 0.0, 0.5) == 50  # ⌈log(1e-15) / log 0.5⌉ = ⌈49.8⌉, before method.l_max's clip
    assert local_steps(100.0, 1.0, 0.0, 0.5) == 1  # ⌈0.01⌉


def test_client_variance_is_across_rounds_not_across_coordinates(tiny_federation, monkeypatch):
    spread = {"w": torch.tensor([-5.0, 0.0, 5.0])}  # coordinate variance 25
    count, mean, m2 = 0, None, None
    for _ in range(3):
        count, mean, m2 = welford_update(count, mean, m2, spread)
    assert welford_variance(count, m2) == 0.0
    count, mean, m2 = welford_update(count, mean, m2, {"w": torch.tensor([-5.0, 3.0, 5.0])})
    # Coordinate 1 saw 0, 0, 0, 3 (sample variance 2.25), the others did not move: mean over 3 coordinates.
    assert welford_variance(count, m2) == pytest.approx(2.25 / 3)

    context, model = make_context(tiny_federation)
    method = SelfFL(SelfFLConfig(eps=1e-7), context, {k: v.clone() for k, v in model.state_dict().items()})
    trained = {k: torch.linspace(-1, 1, v.numel()).reshape(v.shape) for k, v in model.state_dict().items()}
    monkeypatch.setattr(sequential(context).trainer, "train", lambda *a, **k: TrainResult(trained, 0.0, 1))
    uploads = []
    for round_ in (1, 2, 3):
        message = method.server_message(0, round_ - 1)
        context.store.set(0, "model", method.pre_local_init(0, message, round_ - 1))
        result = run_hook(context, method.local_train(0, context.store.get(0, "model"), message, round_))
        uploads.append(method.client_message(0, result, round_))
    assert math.isnan(uploads[0][SIGMA_SQ].item())  # one upload: no variance yet
    assert uploads[1][SIGMA_SQ].item() == uploads[2][SIGMA_SQ].item() == 1e-7  # 0, floored at eps


def test_loo_init_and_leave_one_out_by_hand():
    # Three clients, weights 1, 1, 2 (W = 4), models 5, 1, 1: Θ = (5 + 1 + 2) / 4 = 2.
    share, loo_variance = leave_one_out(1.0, 4.0)
    assert (share, loo_variance) == (0.25, 1 / 3)  # w̃ = w/W, v_{-m} = 1/(W − w)
    init = loo_init({"w": torch.tensor([2.0]), "n": torch.tensor(7)}, {"w": torch.tensor([5.0])}, share)
    assert init["w"].item() == pytest.approx(1.0)  # (1·1 + 2·1) / 3: client 0 removed (Eq. 10)
    assert init["n"].item() == 7
    with pytest.raises(ValueError):
        leave_one_out(2.0, 2.0)


def test_aggregation_by_hand(tiny_federation):
    context, model = make_context(tiny_federation, join_ratio=0.5)
    zeros = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    method = SelfFL(SelfFLConfig(warmup_rounds=0), context, zeros)

    def model_of(value):
        return {k: torch.full_like(v, value) for k, v in zeros.items()}

    def message(value, sigma_sq):
        return {**model_of(value), SIGMA_SQ: torch.tensor(sigma_sq, dtype=torch.float64)}

    assert across_variance([model_of(1.0), model_of(3.0)]) == 2.0
    method.aggregate({0: message(1.0, 2.0), 1: message(3.0, 6.0)}, round_=1)
    # σ_0² = 2: w = 1/4, 1/8; Θ̂ = (1/4 · 1 + 1/8 · 3) / (3/8) = 5/3 (Eq. 11); Θ = 0.5 · 0 + 0.5 · 5/3.
    assert method.sigma0_sq == 2.0
    assert all(torch.allclose(v, torch.full_like(v, 5 / 6)) for v in method.global_params.values())
    # W over all four clients; clients 2 and 3 count with the mean σ² = 4: 1/4 + 1/8 + 2/6 = 17/24.
    sent = method.server_message(2, round_=1)
    assert sent[SIGMA0_SQ].item() == 2.0 and sent[TOTAL_WEIGHT].item() == pytest.approx(17 / 24)
    assert sent.keys() - zeros.keys() == {SIGMA0_SQ, TOTAL_WEIGHT}


def test_aggregation_by_samples_is_the_ablations_fedavg_weights_smoothed(tiny_federation):
    context, model = make_context(tiny_federation, join_ratio=0.5)
    zeros = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    method = SelfFL(SelfFLConfig(warmup_rounds=0, aggregation="samples"), context, zeros)
    uploads = {
        i: {**{k: torch.full_like(v, value) for k, v in zeros.items()}, SIGMA_SQ: torch.tensor(s, dtype=torch.float64)}
        for i, value, s in ((0, 1.0, 2.0), (1, 3.0, 6.0))
    }
    method.aggregate(uploads, round_=1)
    # Clients 0 and 1 hold 10 and 20 training samples: Θ̂ = (10 · 1 + 20 · 3) / 30 = 7/3; Θ = 0.5 · 0 + 0.5 · 7/3.
    assert all(torch.allclose(v, torch.full_like(v, 7 / 6)) for v in method.global_params.values())


def selffl_rows(digits_config, **options) -> list[dict[str, str]]:
    """tables/selffl_clients.csv of a 3-round Self-FL digits run (every client every round, warm-up 1)."""
    config = digits_config(**{"method.name": "selffl", "method.warmup_rounds": 1, "method.l_max": 10, **options})
    run_dir, summary = run_experiment(config)
    assert summary["status"] == "completed"
    with open(run_dir / "tables" / "selffl_clients.csv") as f:
        return list(csv.DictReader(f))


def test_fixed_steps_train_the_baselines_steps_where_the_rule_would_train_l_m(digits_config):
    rows = selffl_rows(digits_config, **{"method.steps": "fixed", "federation.local_steps": 3})
    ruled = [r for r in rows if r["rule_steps"]]
    assert len(ruled) == 5  # round 3: the five clients with two uploads
    assert {r["local_steps"] for r in ruled} == {"3"} and {r["rule_steps"] for r in ruled} != {"3"}


def test_warmup_uploads_enter_the_variance_unless_switched_off(digits_config):
    with_warmup = selffl_rows(digits_config)
    without = selffl_rows(digits_config, **{"method.warmup_variance": False})
    # Round r's row counts the uploads that entered σ_m²: r, or r − 1 without the warm-up round's.
    assert [r["uploads"] for r in with_warmup] == ["1"] * 5 + ["2"] * 5 + ["3"] * 5
    assert [r["uploads"] for r in without] == [""] * 5 + ["1"] * 5 + ["2"] * 5
    # Without: the first σ_m² comes at round 3, so round 3 still trains FedAvg-style (no l_m yet).
    assert not any(r["rule_steps"] for r in without) and all(r["rule_steps"] for r in with_warmup[10:])


def test_bad_options_are_rejected(tiny_federation, digits_config):
    with pytest.raises(ConfigError, match="method.init"):
        digits_config(**{"method.name": "selffl", "method.init": "zero"})
    with pytest.raises(ConfigError, match="Unknown config key 'method.ala'"):  # Self-FL has its own init (Eq. 10)
        digits_config(**{"method.name": "selffl", "method.ala.s": 50})
    context, model = make_context(tiny_federation)
    with pytest.raises(ConfigError, match="l_min"):
        SelfFL(SelfFLConfig(l_min=5, l_max=4), context, model.state_dict())
    context, model = make_context(tiny_federation, lr=1.0)
    with pytest.raises(ConfigError, match="lr"):
        SelfFL(SelfFLConfig(), context, model.state_dict())


def test_fedavg_style_training_in_warmup_and_before_two_uploads(tiny_federation):
    context, model = make_context(tiny_federation, lr=0.3)
    method = SelfFL(SelfFLConfig(warmup_rounds=5), context, model.state_dict())
    received = {SIGMA0_SQ: torch.tensor(1.0, dtype=torch.float64), TOTAL_WEIGHT: torch.tensor(2.0, dtype=torch.float64)}
    assert method.plan(0, received, round_=6) is None  # fewer than two uploads: no σ_m²
    context.store.set(0, "selffl_sigma_sq", 1.0)
    assert method.plan(0, received, round_=5) is None  # warm-up
    # w = 1/2, W = 2: w̃ = 1/4, v = 2/3; (0.7)^l = 1 / (1 + 1 + 2/3) = 3/8 → l = ⌈2.75⌉.
    assert method.plan(0, received, round_=6) == (0.25, 3)
    received[TOTAL_WEIGHT] = torch.tensor(0.5, dtype=torch.float64)
    assert method.plan(0, received, round_=6) is None  # W = w: no other client to learn from


def test_selffl_runs_on_digits(digits_config):
    # l_max = 10 steps of 20 samples: a Self-FL round costs less than an epoch (~270 samples).
    run_dir, summary = run_experiment(
        digits_config(**{"method.name": "selffl", "method.warmup_rounds": 0, "method.l_max": 10, "federation.lr": 0.1})
    )
    assert summary["status"] == "completed" and summary["final_accuracy"] > 0.5
    with open(run_dir / "metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    assert metrics[-1]["selffl_sigma0_sq"] and float(metrics[-1]["selffl_local_steps_mean"]) >= 1
    with open(run_dir / "tables" / "selffl_clients.csv") as f:
        rows = list(csv.DictReader(f))
    # Rounds 1-2: epochs (fewer than two uploads); round 3: l_m steps, from σ_m² > 0.
    assert [bool(r["local_steps"]) for r in rows] == [False] * 10 + [True] * 5
    assert all(1 <= int(r["local_steps"]) <= 10 and float(r["sigma_sq"]) > 0 for r in rows[10:])
    # The steps trained are Eq. 8's l_m clipped to l_max; the rule's own value is logged too.
    assert all(int(r["local_steps"]) == min(int(r["rule_steps"]), 10) for r in rows[10:])
    rule = sorted(int(r["rule_steps"]) for r in rows[10:])
    assert float(metrics[-1]["selffl_rule_steps_median"]) == rule[2]  # median of the round's 5 clients
    n_params = summary["num_parameters"]
    assert summary["params_sent_per_round"] == 5 * (n_params + 2)  # model + σ_0² + W
    assert summary["params_received_per_round"] == 5 * (n_params + 1)  # model + σ_m²
