"""Robust aggregation (aggregation.*): each rule against hand-computed values, its errors, the methods that refuse
it, and FedAvg under sign-flipping clients with the mean, the median and Krum."""

import pytest
import torch

from plfl.errors import ConfigError, FederationError
from plfl.experiment import run_experiment
from plfl.methods import method_class, methods
from plfl.robust import (
    coordinate_median,
    krum,
    krum_scores,
    norm_bounded_mean,
    robust_average,
    trimmed_mean,
    weighted_average,
)
from plfl.sections import AggregationConfig


def states(*values):
    """One state per value: a float tensor ``w`` of the value(s) and an int64 counter that differs per state."""
    return [{"w": torch.tensor(v, dtype=torch.float32), "n": torch.tensor(i)} for i, v in enumerate(values)]


def test_median_is_per_coordinate_and_averages_the_middle_pair_for_even_n():
    odd = coordinate_median(states([1.0, 9.0], [5.0, -2.0], [100.0, 3.0]))
    assert odd["w"].tolist() == [5.0, 3.0] and odd["n"].item() == 0  # the counter: the first state's
    even = coordinate_median(states([1.0], [2.0], [4.0], [100.0]))
    assert even["w"].tolist() == [3.0]


def test_trimmed_mean_drops_the_extremes_at_each_end():
    values = states([-50.0], [1.0], [2.0], [3.0], [60.0])
    assert trimmed_mean(values, 0.2)["w"].tolist() == [2.0]  # ⌊0.2 · 5⌋ = 1 dropped at each end
    assert trimmed_mean(values, 0.1)["w"].item() == pytest.approx(16 / 5)  # ⌊0.5⌋ = 0: the mean
    assert trimmed_mean(values, 0.4)["w"].tolist() == [2.0]  # 2 at each end: the median


def test_krum_scores_sum_the_squared_distances_to_the_nearest_others():
    # n = 5, f = 1: each score sums n − f − 2 = 2 nearest squared distances.
    values = states([0.0], [1.0], [2.0], [3.0], [100.0])
    assert krum_scores(values, 1).tolist() == [1 + 4, 1 + 1, 1 + 1, 1 + 4, 97**2 + 98**2]
    assert krum(values, [1.0] * 5, 1)["w"].tolist() == [1.0]  # ties go to the lower index


def test_krum_picks_an_honest_model_when_one_is_far_away():
    values = states([0.0, 0.0], [0.1, 0.0], [0.0, 0.2], [-1e3, 1e3], [0.1, 0.1])
    chosen = krum(values, [1.0] * 5, 1)["w"]
    assert chosen.abs().max() < 1


def test_multi_krum_averages_the_m_best_by_their_weights():
    values = states([0.0], [1.0], [2.0], [3.0], [100.0])  # scores 5, 2, 2, 5, ...: best 1 and 2
    assert krum(values, [1.0, 1.0, 3.0, 1.0, 1.0], 1, selected=2)["w"].item() == pytest.approx((1 + 3 * 2) / 4)
    config = AggregationConfig(rule="multi_krum", byzantine=1, selected=4)
    assert robust_average(values, [1.0] * 5, values[0], config)["w"].item() == pytest.approx(1.5)


def test_norm_bounding_clips_each_update_to_the_bound_then_takes_the_weighted_mean():
    sent = {"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.0]), "n": torch.tensor(7)}
    far = {"w": torch.tensor([4.0, 1.0]), "b": torch.tensor([4.0]), "n": torch.tensor(1)}  # update (3, 0, 4): ‖·‖ 5
    near = {"w": torch.tensor([1.5, 1.0]), "b": torch.tensor([0.0]), "n": torch.tensor(2)}  # update (0.5, 0, 0)
    combined = norm_bounded_mean([far, near], [1.0, 3.0], sent, 1.0)
    # far's update becomes (0.6, 0, 0.8); near's stays: θ_sent + (1 · far + 3 · near) / 4.
    torch.testing.assert_close(combined["w"], torch.tensor([1 + (0.6 + 1.5) / 4, 1.0]))
    torch.testing.assert_close(combined["b"], torch.tensor([0.8 / 4]))
    assert combined["n"].item() == 1


def test_the_mean_rule_is_weighted_average():
    values = states([1.0, 2.0], [3.0, 5.0])
    expected = weighted_average(values, [1.0, 3.0])
    got = robust_average(values, [1.0, 3.0], values[0], AggregationConfig())
    assert torch.equal(got["w"], expected["w"])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: krum(states([0.0], [1.0], [2.0], [3.0]), [1.0] * 4, 1), "Krum with f=1 Byzantine clients"),
        (lambda: krum(states([0.0], [1.0], [2.0]), [1.0] * 3, 0, selected=4), "m must be in [1, n]; got m=4"),
        (lambda: trimmed_mean(states([0.0], [1.0]), 0.5), "a fraction in [0, 0.5) at each end, not 0.5"),
        (lambda: coordinate_median([]), "needs at least 1 client models, got 0"),
        (lambda: norm_bounded_mean(states([0.0]), [1.0], states([0.0])[0], 0.0), "a norm M > 0, not 0.0"),
    ],
)
def test_each_rule_refuses_bad_input(call, message):
    with pytest.raises(ValueError) as error:
        call()
    assert message in str(error.value)


REFUSING = {
    name
    for name, cls in methods().items()
    if cls.not_averaging is not None  # the methods whose aggregate does not go through Method.average
}


def test_the_methods_that_refuse_robust_rules_are_the_ones_that_do_not_average_models():
    assert REFUSING == {
        "apple",
        "cfl",
        "fedamp",
        "fedas",
        "feddyn",
        "fedfomo",
        "fedft",
        "fedftha",
        "fedpac",
        "fedproto",
        "heurpfedla",
        "ifca",
        "local",
        "pfedhn",
        "pfedla",
        "scaffold",
        "selffl",
    }


@pytest.mark.parametrize("method", sorted(REFUSING))
def test_a_method_that_does_not_average_refuses_a_robust_rule(digits_config, method):
    with pytest.raises(ConfigError) as error:
        run_experiment(digits_config(**{"method.name": method, "aggregation.rule": "median"}))
    why = method_class(method).not_averaging
    assert str(error.value) == (
        f"aggregation.rule=median replaces the mean of client models, but {method} {why}. Set "
        "aggregation.rule=mean, or choose a method that averages client models (fedavg and the methods built on it)."
    )


def test_krum_refuses_rounds_with_too_few_clients(digits_config):
    with pytest.raises(ConfigError) as error:
        run_experiment(digits_config(**{"aggregation.rule": "krum", "aggregation.byzantine": 2}))
    assert str(error.value) == (
        "aggregation.rule=krum with aggregation.byzantine=2 needs at least 7 clients per round (Krum's n > 2f + 2), "
        "but a round samples 5. Lower aggregation.byzantine (or aggregation.selected), or raise "
        "federation.join_ratio."
    )


def test_krum_stops_the_run_naming_the_fix_when_dropouts_leave_too_few_models(digits_config, tmp_path):
    config = {"aggregation.rule": "krum", "aggregation.byzantine": 1, "federation.system.dropout": 0.5}
    with pytest.raises(FederationError) as error:
        run_experiment(digits_config(**config))
    assert str(error.value).startswith(
        "aggregation.rule=krum: Krum with f=1 Byzantine clients (n > 2f + 2) needs at least 5 client models, got "
    )
    assert str(error.value).endswith("sample more clients per round (federation.join_ratio) or relax the rule")
    assert list(tmp_path.rglob("metrics.csv"))  # the rounds before it stay on disk


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"aggregation.trim": 0.2},
            "aggregation.trim=0.2 is read only by aggregation.rule=trimmed_mean, not by aggregation.rule=mean. "
            "Remove aggregation.trim (or set aggregation.rule=trimmed_mean).",
        ),
        ({"aggregation.trim": 0.5}, "Config key 'aggregation.trim' must be a number in [0, 0.5); got 0.5."),
        (
            {"aggregation.rule": "mode"},
            "Config key 'aggregation.rule' must be one of mean, median, trimmed_mean, krum, multi_krum, norm_bound",
        ),
    ],
)
def test_aggregation_keys_are_checked(digits_config, overrides, message):
    with pytest.raises(ConfigError) as error:
        digits_config(**overrides)
    assert message in str(error.value)


def test_under_sign_flipping_clients_the_median_and_krum_keep_the_accuracy_the_mean_loses(digits_config):
    """10 digits clients, 2 of them sending θ_sent − 4u, 8 rounds: FedAvg's mean is driven to chance, the median
    and Krum stay near the clean run."""
    common = {
        "data.num_clients": 10,
        "data.beta": 5.0,
        "federation.rounds": 8,
        "federation.lr": 0.1,
        "federation.batch_size": 10,
        "attack.kind": "sign_flip",
        "attack.fraction": 0.2,
        "attack.scale": 4.0,
    }
    accuracy = {
        rule: run_experiment(digits_config(**common, **{"aggregation.rule": rule}))[1]["final_accuracy"]
        for rule in ("mean", "median", "krum")
    }
    assert accuracy["mean"] < 0.3, accuracy
    assert accuracy["median"] > 0.5 and accuracy["krum"] > 0.5, accuracy
    assert min(accuracy["median"], accuracy["krum"]) - accuracy["mean"] > 0.3, accuracy
