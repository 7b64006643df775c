"""Client-level DP (privacy.*): DP-FedAvg's rule against hand-computed values, its noise, adaptive clipping,
ε against Opacus' accountants, the refusals, and FedAvg on digits under little and much noise."""

import csv
import math
import sys

import pytest
import torch

from plfl.config import resume_config
from plfl.errors import ConfigError
from plfl.experiment import run_experiment
from plfl.privacy import (
    ClientLevelDP,
    adapted_clip,
    clipped_update,
    new_accountant,
    private_mean,
    update_noise_multiplier,
)
from plfl.sections import PrivacyConfig


def generator(seed=7):
    return torch.Generator().manual_seed(seed)


def test_each_update_is_clipped_to_c_and_the_mean_is_unweighted_around_the_sent_model():
    sent = {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor(0)}
    states = [
        {"w": torch.tensor([4.0, 5.0]), "n": torch.tensor(3)},  # u = (3, 4), ‖u‖ = 5 → (0.6, 0.8)
        {"w": torch.tensor([1.3, 1.4]), "n": torch.tensor(4)},  # u = (0.3, 0.4), ‖u‖ = 0.5: kept
    ]
    update, norm = clipped_update(states[0], sent, 1.0)
    assert norm == pytest.approx(5.0) and update["w"].tolist() == pytest.approx([0.6, 0.8]) and "n" not in update
    averaged, norms = private_mean(states, sent, 1.0, 0.0, generator())
    assert averaged["w"].tolist() == pytest.approx([1 + (0.6 + 0.3) / 2, 1 + (0.8 + 0.4) / 2])
    assert norms == pytest.approx([5.0, 0.5])
    assert averaged["n"].item() == 3  # an integer buffer: the first upload's


def test_the_norm_is_over_the_whole_update_and_the_noise_is_the_generators():
    sent = {"a": torch.zeros(2), "b": torch.zeros(2, 1)}
    states = [{"a": torch.tensor([2.0, 0.0]), "b": torch.tensor([[0.0], [2.0]])}]  # ‖u‖ = √8 over a and b together
    z, clip = 0.5, 2.0
    averaged, _ = private_mean(states, sent, clip, z, generator())
    again = generator()
    factor = clip / math.sqrt(8)
    expected_a = torch.tensor([2.0, 0.0]) * factor + z * clip * torch.randn(2, generator=again)
    expected_b = torch.tensor([[0.0], [2.0]]) * factor + z * clip * torch.randn(2, 1, generator=again)
    torch.testing.assert_close(averaged["a"], expected_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(averaged["b"], expected_b, rtol=0, atol=1e-6)


def test_the_noise_has_standard_deviation_z_c_over_m():
    m, z, clip = 4, 1.5, 0.3
    sent = {"w": torch.zeros(200_000)}
    averaged, _ = private_mean([dict(sent) for _ in range(m)], sent, clip, z, generator())
    assert averaged["w"].std().item() == pytest.approx(z * clip / m, rel=0.02)
    assert averaged["w"].mean().item() == pytest.approx(0, abs=0.01 * z * clip / m)


def test_adaptive_clipping_moves_c_by_the_noised_unclipped_fraction():
    norms, clip, sigma = [0.5, 2.0, 3.0, 1.0], 1.0, 0.7  # two of four at most C (1.0 counts)
    new_clip, unclipped = adapted_clip(clip, norms, 0.5, 0.2, sigma, generator(3))
    noise = torch.randn((), generator=generator(3), dtype=torch.float64).item()
    b = (2 + sigma * noise) / 4
    assert unclipped == pytest.approx(b) and new_clip == pytest.approx(clip * math.exp(-0.2 * (b - 0.5)))
    assert adapted_clip(clip, [0.1] * 4, 0.5, 0.2, 1e-9, generator())[0] < clip  # all unclipped: C shrinks
    assert adapted_clip(clip, [9.0] * 4, 0.5, 0.2, 1e-9, generator())[0] > clip  # all clipped: C grows


def test_the_updates_noise_multiplier_is_theorem_ones_and_a_small_quantile_noise_is_refused():
    assert update_noise_multiplier(1.0, 1.0) == pytest.approx(1 / math.sqrt(1 - 1 / 4))
    assert update_noise_multiplier(0.8, None) == 0.8
    with pytest.raises(ValueError, match=r"privacy.quantile_noise \(σ_b = 0.5\) must exceed"):
        update_noise_multiplier(1.0, 0.5)


def test_with_adaptive_clipping_the_server_noises_the_update_at_z_delta_and_moves_c():
    """m = 4 unchanged models (‖u_i‖ = 0 ≤ C: all unclipped, so C shrinks); z = 1, σ_b = 1: z_Δ = 1 / √0.75."""
    config = PrivacyConfig(level="client", noise_multiplier=1.0, clip=0.5, adaptive=True, quantile_noise=1.0)
    privacy = ClientLevelDP(config, seed=0, clients_per_round=4, num_clients=10)
    sent = {"w": torch.zeros(200_000)}
    averaged = privacy.aggregate([dict(sent) for _ in range(4)], sent, round_=1)
    assert averaged["w"].std().item() == pytest.approx(0.5 / math.sqrt(0.75) / 4, rel=0.02)
    assert privacy.clip < 0.5 and privacy.state_dict() == {"clip": privacy.clip, "rounds": 1}
    assert privacy.sample_rate == 0.4 and privacy.epsilon() > 0


def metrics(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_the_reported_epsilon_is_opacus_accountants(digits_config, accountant):
    """3 rounds of 3 of 5 clients (q = 0.6) at z = 1.2: ε each round and at the end as Opacus computes it."""
    options = {"privacy.level": "client", "privacy.noise_multiplier": 1.2, "privacy.accountant": accountant}
    run_dir, summary = run_experiment(digits_config(**options, **{"federation.join_ratio": 0.6}))
    reference, expected = new_accountant(accountant), [0.0]
    for _ in range(3):
        reference.step(noise_multiplier=1.2, sample_rate=0.6)
        expected.append(reference.get_epsilon(delta=1e-5))
    assert [float(row["epsilon"]) for row in metrics(run_dir)] == pytest.approx(expected, rel=1e-9)
    assert summary["epsilon"] == pytest.approx(expected[-1], rel=1e-9) and expected[-1] > 0
    assert (summary["delta"], summary["accountant"]) == (1e-5, accountant)


def test_a_method_that_does_not_average_models_refuses_client_dp(digits_config):
    with pytest.raises(ConfigError, match="privacy.level=client clips and noises .* but scaffold aggregates updates"):
        run_experiment(digits_config(**{"privacy.level": "client", "method.name": "scaffold"}))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"privacy.level": "client", "aggregation.rule": "median"}, "with aggregation.rule=median: client-level DP"),
        ({"privacy.clip": 2.0}, "privacy.clip=2.0 is read only by privacy.level=client"),
        ({"privacy.level": "client", "privacy.clip_lr": 0.1}, "privacy.clip_lr=0.1 is read only by privacy.adaptive"),
        ({"privacy.level": "user"}, "'privacy.level' must be one of none, client, sample"),
    ],
)
def test_keys_that_client_dp_cannot_follow_are_refused(digits_config, options, message):
    with pytest.raises(ConfigError, match=message):
        digits_config(**options)


def test_a_quantile_noise_too_small_for_z_is_refused_before_the_run(digits_config, tmp_path):
    """5 clients a round: σ_b's default is 5 / 20 = 0.25, below z / 2 = 0.5."""
    options = {"privacy.level": "client", "privacy.adaptive": True, "output_dir": str(tmp_path / "runs")}
    with pytest.raises(ConfigError, match=r"privacy.adaptive=true: privacy.quantile_noise \(σ_b = 0.25\)"):
        run_experiment(digits_config(**options))
    assert not (tmp_path / "runs").exists()


def test_a_resumed_run_cannot_change_privacy(digits_config):
    run_dir, _ = run_experiment(digits_config(**{"privacy.level": "client", "federation.rounds": 1}))
    with pytest.raises(ConfigError, match="--resume cannot change privacy"):
        resume_config(run_dir, ["federation.rounds=2", "privacy.noise_multiplier=2"])


def test_without_opacus_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "opacus", None)
    monkeypatch.setitem(sys.modules, "opacus.accountants", None)
    with pytest.raises(ConfigError, match=r"pip install 'plfl\[privacy\]'"):
        new_accountant("rdp")


@pytest.mark.filterwarnings("ignore:Optimal order is the smallest alpha")  # Opacus, on z = 0.01's huge ε
def test_more_noise_costs_accuracy_and_buys_a_smaller_epsilon(digits_config):
    """FedAvg on digits, 8 rounds, C = 10: z = 0.01 learns (above 40 % accuracy), z = 5 stays near chance (10 %)."""
    results = {}
    for z in (0.01, 1.0, 5.0):
        options = {"privacy.level": "client", "privacy.noise_multiplier": z, "privacy.clip": 10.0}
        _, summary = run_experiment(digits_config(**options, **{"federation.rounds": 8}))
        results[z] = summary["final_accuracy"], summary["epsilon"]
    assert results[0.01][0] > 0.4 and results[5.0][0] < 0.25
    assert results[0.01][1] > results[1.0][1] > results[5.0][1]
