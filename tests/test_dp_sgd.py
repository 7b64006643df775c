"""Sample-level DP (privacy.level=sample): one DP-SGD step against a hand computation, each client's ε against
Opacus' accountant, σ for a target ε, the sequential and vectorized executors' equal numbers, a bit-for-bit resume,
FedAvg on digits under little and much noise, and the refusals."""

import csv
import inspect
import math
import re
import warnings

import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from torch import nn

from plfl.client import ClientModule, LocalTrainer, build_trainer
from plfl.config import resume_config
from plfl.data import load_federated_data
from plfl.errors import ConfigError, PlflWarning
from plfl.executors.steps import FunctionalNetwork
from plfl.experiment import run_experiment
from plfl.methods import build_method, method_class, methods
from plfl.methods.ala import ALAStep
from plfl.methods.base import Method
from plfl.models import build_model
from plfl.privacy import SampleLevelDP, noise_generator, private_gradient
from plfl.sections import DPSGDNoise, PrivacyConfig
from plfl.tasks import Batch

from conftest import make_context, matrix_config, run_results

SAMPLE = {"privacy.level": "sample"}


def test_one_step_clips_each_samples_gradient_sums_noises_and_divides_by_the_batch_size():
    """A 2 × 2 linear layer at W = 0 on two samples: softmax(Wx) = (½, ½), so g_j = (p − e_y) x_jᵀ."""
    x = torch.tensor([[3.0, 4.0], [0.1, 0.0]])
    y = torch.tensor([0, 1])
    g1 = torch.tensor([[-0.5], [0.5]]) * x[0]  # ‖g1‖ = √12.5 > C: scaled to C = 1
    g2 = torch.tensor([[0.5], [-0.5]]) * x[1]  # ‖g2‖ = √0.005 < C: kept
    sigma, clip, lr, seed = 0.7, 1.0, 0.1, 5
    noise = torch.normal(mean=0, std=sigma * clip, size=(2, 2), generator=noise_generator(seed, torch.device("cpu")))
    expected = (g1 / (math.sqrt(12.5) + 1e-6) + g2 + noise) / 2

    computed = private_gradient([torch.stack([g1, g2])], torch.ones(2), [noise], clip, batch_size=2)
    torch.testing.assert_close(computed[0], expected)

    model = nn.Linear(2, 2, bias=False)
    module = ClientModule(model, 2, lr, dp_sgd=DPSGDNoise(sigma, clip), batch_size=2)
    trainer = LocalTrainer(module, build_trainer("cpu", 1, "32-true"), batch_size=2)
    result = trainer.train({"weight": torch.zeros(2, 2)}, x, y, seed=seed, steps=1)  # Opacus' DPOptimizer
    torch.testing.assert_close(result.params["weight"], -lr * expected)


def client_sizes(config) -> list[int]:
    return [c.num_train for c in load_federated_data(config.data, config.federation.seed).clients]


def last_round_rows(run_dir) -> list[dict]:
    with open(run_dir / "clients.csv") as f:
        rows = list(csv.DictReader(f))
    last = max(int(r["round"]) for r in rows)
    return sorted((r for r in rows if int(r["round"]) == last), key=lambda r: int(r["client"]))


@pytest.mark.parametrize("accountant", [RDPAccountant, PRVAccountant])
def test_each_clients_epsilon_is_opacus_accountant_of_its_local_steps(digits_config, accountant):
    """Every client trains in each of 3 rounds one epoch of ⌈n/B⌉ steps at q = B/n."""
    name = "rdp" if accountant is RDPAccountant else "prv"
    config = digits_config(**SAMPLE, **{"privacy.noise_multiplier": 1.3, "privacy.accountant": name})
    run_dir, summary = run_experiment(config)
    rows = last_round_rows(run_dir)
    expected = []
    for n in client_sizes(config):
        direct = accountant()
        for _ in range(3 * math.ceil(n / 20)):
            direct.step(noise_multiplier=1.3, sample_rate=20 / n)
        expected.append(direct.get_epsilon(delta=1e-5))
    assert [float(r["epsilon"]) for r in rows] == pytest.approx(expected, rel=1e-9)
    assert summary["epsilon_max"] == pytest.approx(max(expected), rel=1e-9)
    assert summary["epsilon_mean"] == pytest.approx(sum(expected) / len(expected), rel=1e-9)
    assert (summary["delta"], summary["accountant"], summary["noise_multiplier"]) == (1e-5, name, 1.3)


def test_fedalas_epsilon_counts_alas_steps_after_the_first_round(digits_config):
    """Each of the 3 rounds' broadcasts runs ALA on every client: one epoch of ⌈⌊0.8 n⌋ / B⌉ private steps on its
    80 % sample, each at the training's rate q = B / n, beside the training's ⌈n/B⌉ steps."""
    config = digits_config(**SAMPLE, **{"privacy.noise_multiplier": 1.1, "method.name": "fedala"})
    run_dir, summary = run_experiment(config)
    expected = []
    for n in client_sizes(config):
        direct = RDPAccountant()
        for _ in range(3 * math.ceil(n / 20) + 3 * math.ceil(int(0.8 * n) / 20)):
            direct.step(noise_multiplier=1.1, sample_rate=20 / n)
        expected.append(direct.get_epsilon(delta=1e-5))
    assert [float(r["epsilon"]) for r in last_round_rows(run_dir)] == pytest.approx(expected, rel=1e-9)
    assert summary["epsilon_max"] == pytest.approx(max(expected), rel=1e-9)


def test_a_private_ala_step_clips_each_samples_weight_gradient_and_adds_the_noise(tiny_federation):
    """FedALA's Eq. 5 under DP-SGD on a linear model's two tensors: ∇_W ℓ_j = ∇_Θ̂ ℓ_j ⊙ (Θ − Θ_i), clipped to C,
    summed with the noise, over B, then W − η g̃ clamped to [0, 1], against autograd sample by sample."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    network = FunctionalNetwork(model, torch.device("cpu"))
    local = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    received = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    weights = {k: torch.full_like(v, 0.5) for k, v in local.items()}
    x, y = torch.randn(3, 4), torch.tensor([0, 2, 1])
    noise = {k: 0.3 * torch.randn_like(v) for k, v in local.items()}
    eta, clip, batch_size = 0.7, 0.2, 4
    step = ALAStep(eta, ("weight", "bias"), False, clip, batch_size)
    inputs = {**{f"local/{k}": v for k, v in local.items()}, **{f"gap/{k}": received[k] - local[k] for k in local}}
    out = step(network, weights, inputs, received, Batch(x, y, None, noise))

    total = {k: noise[k].clone() for k in local}
    for j in range(3):
        w = {k: v.clone().requires_grad_() for k, v in weights.items()}
        theta = {k: local[k] + (received[k] - local[k]) * w[k] for k in local}
        loss = nn.functional.cross_entropy(theta["weight"] @ x[j] + theta["bias"], y[j])
        grads = torch.autograd.grad(loss, [w["weight"], w["bias"]])
        norm = torch.cat([g.flatten() for g in grads]).norm()
        for k, g in zip(("weight", "bias"), grads):
            total[k] += g * min(1.0, clip / (norm.item() + 1e-6))
    for k in local:
        torch.testing.assert_close(out.state[k], (weights[k] - eta * total[k] / batch_size).clamp(0, 1))


# Epochs a client trains in 3 rounds. Ditto: v's training and w's; FedFTHA: the joint epoch, then the head's 2;
# FedRep: the head's 2, then the body's; FedBABU: one a round, then 4 of fine-tuning in the last round.
@pytest.mark.parametrize(
    "method, options, epochs",
    [
        ("fedavg", {}, 3),
        ("ditto", {}, 6),
        ("fedftha", {"method.head_epochs": 2}, 9),
        ("fedrep", {"method.head_epochs": 2}, 9),
        ("fedbabu", {"method.fine_tuning_epochs": 4}, 7),
    ],
)
def test_a_target_epsilon_chooses_the_sigma_that_the_worst_client_reaches_it_with(
    digits_config, method, options, epochs
):
    config = digits_config(**SAMPLE, **{"privacy.target_epsilon": 3.0, "method.name": method, **options})
    _, summary = run_experiment(config)
    sigma = summary["noise_multiplier"]
    trainings = {(20 / n, epochs * math.ceil(n / 20)) for n in client_sizes(config)}
    assert sigma == max(
        get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=q, steps=s) for q, s in trainings
    )
    assert 3.0 - 0.01 <= summary["epsilon_max"] <= 3.0  # Opacus' tolerance: ε within 0.01 below the target


def test_self_fls_target_epsilon_counts_l_max_steps_in_each_round_after_the_warm_up(digits_config):
    """3 rounds, warm-up 1: one epoch in round 1, then up to l_max = 30 steps (more than an epoch) in rounds 2-3.
    The steps Eq. 8 gives are known only as the run goes, so σ is the bound's and no client ends above the target."""
    options = {"method.name": "selffl", "method.warmup_rounds": 1, "method.l_max": 30}
    config = digits_config(**SAMPLE, **{"privacy.target_epsilon": 3.0, **options})
    _, summary = run_experiment(config)
    trainings = {(20 / n, math.ceil(n / 20) + 2 * max(30, math.ceil(n / 20))) for n in client_sizes(config)}
    assert summary["noise_multiplier"] == max(
        get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=q, steps=s) for q, s in trainings
    )
    assert summary["epsilon_max"] <= 3.0


def run(digits_config, executor, **options):
    config = digits_config(**SAMPLE, **{"federation.executor": executor, **options})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="federation.executor=vectorized")  # no fallback
        return run_results(run_experiment(config)[0])


@pytest.mark.parametrize(
    "method, options",
    [
        ("fedavg", {"privacy.noise_multiplier": 0.8, "federation.batch_size": 13}),  # short last batches
        ("ditto", {"privacy.noise_multiplier": 0.8, "federation.momentum": 0.5}),  # proximal term, momentum
        ("fedrep", {"privacy.noise_multiplier": 0.5}),  # a trainable subset
        ("fedala", {"privacy.noise_multiplier": 0.6, "method.p": 1}),  # ALA's private steps, their noise
    ],
)
def test_sample_dp_runs_vectorized_as_sequential(digits_config, method, options):
    """The noise comes from each training's seed, drawn as Opacus draws it: the same numbers on either executor."""
    options = {"method.name": method, **options}
    sequential = run(digits_config, "sequential", **options)
    vectorized = run(digits_config, "vectorized", **options, **{"vectorized.cohort_size": 3})
    assert_same_runs(sequential, vectorized)


def assert_same_runs(one_run, other_run):
    """Two runs' :func:`run_results`: equal metrics and client rows within 10⁻⁴, final models within 10⁻⁵."""
    for one, other in zip(one_run[:2], other_run[:2], strict=True):
        for a, b in zip(one, other, strict=True):
            assert a.keys() == b.keys()
            for key in a:
                try:
                    assert float(a[key]) == pytest.approx(float(b[key]), abs=1e-4, nan_ok=True), key
                except ValueError:
                    assert a[key] == b[key]
    for one, other in zip(one_run[2], other_run[2], strict=True):
        for key in one:
            torch.testing.assert_close(one[key], other[key], atol=1e-5, rtol=0)


# The methods that take sample-level DP with their matrix options (tests/test_executors.py's matrix).
ACCEPTED = (
    "cfl", "ditto", "fedala", "fedamp", "fedavg", "fedavg_c", "fedavg_e", "fedavgm", "fedbabu", "fedft", "fedftha",
    "fedopt", "fedper", "fedprox", "fedprox_c", "fedrep", "heurpfedla", "knnper", "lgfedavg", "local", "pfedhn",
    "pfedla", "selffl",
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("method", ACCEPTED)
def test_every_method_that_takes_sample_dp_runs_vectorized_as_sequential(tmp_path, method):
    def results(executor):
        config = matrix_config(tmp_path / executor, method, executor, **SAMPLE, **{"privacy.noise_multiplier": 0.7})
        return run_results(run_experiment(config)[0])

    sequential, vectorized = results("sequential"), results("vectorized")
    assert [r["epsilon_max"] for r in sequential[0]] == [r["epsilon_max"] for r in vectorized[0]]
    assert [r["correct"] for r in sequential[1]] == [r["correct"] for r in vectorized[1]]
    for one, other in zip(sequential[2], vectorized[2]):
        for key in one:
            torch.testing.assert_close(one[key], other[key], atol=1e-5, rtol=0)


def test_augmented_batches_train_privately_on_either_executor(digits_config):
    """The crop and flip come before the per-sample gradients; the vectorized executor hands the training to the
    sequential one (with its notice), so both give the same run."""
    options = {"data.augment": True, "privacy.noise_multiplier": 0.8, "federation.rounds": 2}
    sequential = run_results(run_experiment(digits_config(**SAMPLE, **options))[0])
    with pytest.warns(PlflWarning, match="data.augment draws random crops and flips"):
        config = digits_config(**SAMPLE, **options, **{"federation.executor": "vectorized"})
        vectorized = run_results(run_experiment(config)[0])
    assert_same_runs(sequential, vectorized)
    assert float(sequential[0][-1]["epsilon_max"]) > 0


def test_a_resumed_run_equals_an_uninterrupted_one_bit_for_bit(digits_config, tmp_path):
    options = {**SAMPLE, "privacy.noise_multiplier": 0.9}
    whole_dir, whole = run_experiment(digits_config(**options))
    first_dir, _ = run_experiment(digits_config(**options, **{"federation.rounds": 2}))
    resumed_dir, resumed = run_experiment(resume_config(first_dir, ["federation.rounds=3"]), resume=first_dir)
    one, other = run_results(whole_dir), run_results(resumed_dir)
    assert one[:2] == other[:2]
    for a, b in zip(one[2], other[2]):
        for key in a:
            assert torch.equal(a[key], b[key])
    assert whole["epsilon_max"] == resumed["epsilon_max"]


def test_a_resume_cannot_add_rounds_to_a_target_epsilons_sigma(digits_config):
    run_dir, _ = run_experiment(digits_config(**SAMPLE, **{"privacy.target_epsilon": 8.0, "federation.rounds": 1}))
    with pytest.raises(ConfigError, match="cannot change federation.rounds .* σ was computed for federation.rounds=1"):
        resume_config(run_dir, ["federation.rounds=2"])


@pytest.mark.filterwarnings("ignore:Optimal order is the smallest alpha")  # Opacus, on σ = 0.05's huge ε
def test_more_noise_costs_accuracy_and_buys_a_smaller_epsilon(digits_config):
    """FedAvg on digits, 5 rounds at lr 0.5, C = 1: σ = 0.05 learns (above 60 % accuracy), σ = 8 stays near chance."""
    results = {}
    for sigma in (0.05, 1.0, 8.0):
        options = {**SAMPLE, "privacy.noise_multiplier": sigma, "federation.rounds": 5, "federation.lr": 0.5}
        _, summary = run_experiment(digits_config(**options))
        results[sigma] = summary["final_accuracy"], summary["epsilon_max"]
    assert results[0.05][0] > 0.6 and results[8.0][0] < 0.3
    assert results[0.05][1] > results[1.0][1] > results[8.0][1] > 0


# The options under which a method's own steps run (by default they do not).
OWN_STEPS = {"partialfed": {"strategy": "adaptive"}}


def built_class(name: str, context, **options) -> tuple[type, Exception | None]:
    cls = method_class(name)
    config = cls.config_class(name=name, **options)
    initial = {k: v.clone() for k, v in cls.client_network(context.architecture).state_dict().items()}
    try:
        method = build_method(config, context, initial)
    except ConfigError as error:
        return cls, error
    return type(method), None


@pytest.mark.parametrize("name", sorted(methods()))
def test_a_method_refuses_exactly_when_its_code_reads_samples_outside_the_training_loop(tiny_federation, name):
    """Read from the source: a method whose classes make step tasks, or evaluate on samples of the client's own
    to choose by, refuses sample-level DP. ALA's step tasks carry DP-SGD's noise (the tests above)."""
    # FedBN keeps BatchNorm layers local and needs some: the run refuses them for sample-level DP, the method not.
    batch_norm = name == "fedbn"
    model = build_model("mlp", tiny_federation.input_shape, 3, hidden_sizes=[16], batch_norm=batch_norm)
    context, _ = make_context(tiny_federation, model)
    context.architecture = method_class(name).client_network(model)
    context.dp_sgd = SampleLevelDP(PrivacyConfig(level="sample"), 1.0, 5, 1)
    cls, error = built_class(name, context, **OWN_STEPS.get(name, {}))
    own = [c for c in cls.__mro__ if issubclass(c, Method) and c is not Method]
    sources = [inspect.getsource(inspect.getmodule(c)) for c in own]
    reads_samples = any(re.search(r"step_task\(|StepTask\(|EvalTask\([^)]*samples=", s) for s in sources)
    assert (error is not None) == reads_samples, error


def test_partialfeds_fixed_strategy_trains_in_the_plain_loop_and_is_accepted(tiny_federation):
    context, _ = make_context(tiny_federation)
    context.dp_sgd = SampleLevelDP(PrivacyConfig(level="sample"), 1.0, 5, 1)
    assert built_class("partialfed", context, strategy="fixed")[1] is None


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {**SAMPLE, "method.name": "scaffold"},
            "privacy.level=sample runs DP-SGD in the plain local training only, but scaffold trains y",
        ),
        (
            {**SAMPLE, "method.name": "ifca"},
            "but ifca picks its cluster by the cluster models' losses on its training samples, which would read",
        ),
        ({**SAMPLE, "model.batch_norm": True}, "BatchNorm layer of model.name=mlp .*GroupNorm"),
    ],
)
def test_what_dp_sgd_cannot_privatise_is_refused_before_the_run(digits_config, tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        run_experiment(digits_config(**options, output_dir=str(tmp_path / "runs")))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"privacy.max_grad_norm": 2.0}, "privacy.max_grad_norm=2.0 is read only by privacy.level=sample"),
        ({"privacy.level": "client", "privacy.target_epsilon": 3.0}, "read only by privacy.level=sample, not by "),
        ({**SAMPLE, "privacy.clip": 2.0}, "privacy.clip=2.0 is read only by privacy.level=client, not by privacy.lev"),
        (
            {**SAMPLE, "privacy.target_epsilon": 3.0, "privacy.noise_multiplier": 2.0},
            "σ is computed from the target ε. Remove one of them",
        ),
    ],
)
def test_keys_that_sample_dp_does_not_read_are_refused(digits_config, options, message):
    with pytest.raises(ConfigError, match=message):
        digits_config(**options)
