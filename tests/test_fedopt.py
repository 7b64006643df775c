"""FedOpt: FedAdagrad's, FedYogi's and FedAdam's server steps against hand-computed values, the sample-weighted
pseudo-gradient, checkpointed moments and the keys' ranges."""

import math
from pathlib import Path

import pytest
import torch

from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.methods.fedopt import FedOpt, FedOptConfig, adaptive_server_step

from conftest import make_context

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "fedopt.yaml"


def config(optimizer: str) -> FedOptConfig:
    return FedOptConfig(server_optimizer=optimizer, server_lr=0.1, beta1=0.5, beta2=0.75, tau=0.5)


# x_t = (1, -2), x̄ = (2, -2): Δ = (1, 0); m = 0.5·0 + 0.5·Δ = (0.5, 0); v starts at τ² = 0.25.
# Adagrad: v = 0.25 + Δ² = (1.25, 0.25).  Adam: v = 0.75·0.25 + 0.25·Δ² = (0.4375, 0.1875).
# Yogi: v = 0.25 - 0.25·Δ²·sign(0.25 - Δ²) = (0.5, 0.25).  x = x_t + 0.1 m / (√v + 0.5): only x[0] moves.
@pytest.mark.parametrize("optimizer, v0", [("adagrad", 1.25), ("adam", 0.4375), ("yogi", 0.5)])
def test_first_step_of_each_optimizer(optimizer, v0):
    x = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64), "count": torch.tensor(3)}
    mean = {"w": torch.tensor([2.0, -2.0], dtype=torch.float64), "count": torch.tensor(7)}
    new, moments = adaptive_server_step(x, mean, None, config(optimizer))
    torch.testing.assert_close(moments["m"]["w"], torch.tensor([0.5, 0.0], dtype=torch.float64))
    v1 = {"adagrad": 0.25, "adam": 0.1875, "yogi": 0.25}[optimizer]
    torch.testing.assert_close(moments["v"]["w"], torch.tensor([v0, v1], dtype=torch.float64))
    torch.testing.assert_close(new["w"], torch.tensor([1 + 0.05 / (math.sqrt(v0) + 0.5), -2.0], dtype=torch.float64))
    assert new["count"].item() == 7 and "count" not in moments["m"]  # integer buffers: the mean's, no moments


def test_yogi_shrinks_v_where_it_exceeds_the_squared_update():
    # Second round from the first's state: Δ = (-0.25, 0), m = 0.5·0.5 + 0.5·(-0.25) = 0.125; v (0.5) > Δ² (0.0625),
    # so v = 0.5 - 0.25·0.0625 = 0.484375 (FedAdam's would be 0.75·0.5 + 0.25·0.0625 = 0.390625).
    x = {"w": torch.tensor([1.0], dtype=torch.float64)}
    x1, moments = adaptive_server_step(x, {"w": torch.tensor([2.0], dtype=torch.float64)}, None, config("yogi"))
    x2, moments = adaptive_server_step(x1, {"w": x1["w"] - 0.25}, moments, config("yogi"))
    torch.testing.assert_close(moments["m"]["w"], torch.tensor([0.125], dtype=torch.float64))
    torch.testing.assert_close(moments["v"]["w"], torch.tensor([0.484375], dtype=torch.float64))
    torch.testing.assert_close(x2["w"], x1["w"] + 0.0125 / (math.sqrt(0.484375) + 0.5))


def make_method(tiny_federation, **options) -> FedOpt:
    context, model = make_context(tiny_federation)
    return FedOpt(FedOptConfig(**options), context, {k: v.clone() for k, v in model.state_dict().items()})


def test_the_pseudo_gradient_is_the_sample_weighted_mean_update(tiny_federation):
    # Clients 0 and 2 hold 10 and 30 training samples: Δ = (10·0.4 + 30·0.8) / 40 = 0.7 on every entry, so with
    # β₁ = 0 and FedAdagrad, v = τ² + 0.49 and x moves by η·0.7 / (√(τ² + 0.49) + τ).
    method = make_method(tiny_federation, server_optimizer="adagrad", beta1=0.0, server_lr=0.2, tau=0.1)
    start = method.global_params
    method.aggregate({0: {k: v + 0.4 for k, v in start.items()}, 2: {k: v + 0.8 for k, v in start.items()}}, 1)
    step = 0.2 * 0.7 / (math.sqrt(0.01 + 0.49) + 0.1)
    for key, value in start.items():
        torch.testing.assert_close(method.global_params[key], value + step)


def test_moments_are_server_state_and_resume(tiny_federation):
    method, fresh = make_method(tiny_federation), make_method(tiny_federation)
    first, second = [
        {i: {k: v + shift * (i + 1) for k, v in method.global_params.items()} for i in (0, 2)} for shift in (0.1, -0.3)
    ]
    method.aggregate(first, round_=1)
    state = method.state_dict()
    assert set(state) == {"global_params", "moments"} and set(state["moments"]) == {"m", "v"}
    fresh.load_state_dict(state)
    method.aggregate(second, round_=2)
    fresh.aggregate(second, round_=2)
    assert all(torch.equal(fresh.global_params[k], v) for k, v in method.global_params.items())


def test_fedopt_takes_ala():
    cfg = load_config(CONFIG, ["method.ala.s=50", "method.server_optimizer=yogi"])
    assert cfg.method.ala.s == 50 and cfg.method.server_optimizer == "yogi"


@pytest.mark.parametrize(
    "override, message",
    [
        ("method.server_optimizer=sgd", "must be one of adam, yogi, adagrad; got 'sgd'"),
        ("method.beta1=1", "Config key 'method.beta1' must be a number in [0, 1); got 1.0."),
        ("method.tau=0", "Config key 'method.tau' must be a number > 0; got 0.0."),
    ],
)
def test_out_of_range_keys_are_refused_with_the_key_named(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, [override])
    assert message in str(info.value)
