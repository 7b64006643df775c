"""FedOpt (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, arXiv:2003.00295): FedAdagrad, FedYogi, FedAdam.

FedAvg's clients; the server treats the round's mean update as a pseudo-gradient and steps with an adaptive
optimiser (Alg. 2). With x_t the global model and Δ_t the mean of the sampled clients' updates x_i − x_t:

    m_t = β₁ m_{t−1} + (1 − β₁) Δ_t
    v_t = v_{t−1} + Δ_t²                                      FedAdagrad
    v_t = v_{t−1} − (1 − β₂) Δ_t² sign(v_{t−1} − Δ_t²)          FedYogi
    v_t = β₂ v_{t−1} + (1 − β₂) Δ_t²                            FedAdam
    x_{t+1} = x_t + η m_t / (√v_t + τ)

elementwise, from m_{−1} = 0 and v_{−1} = τ² (Alg. 2's v_{−1} ≥ τ², at its bound). ``method.server_optimizer``
picks v's rule; η, β₁, β₂ and τ are ``method.server_lr``, ``.beta1``, ``.beta2``, ``.tau``. m and v are server state,
saved in checkpoints. Only ``aggregate`` changes, so ``method.ala`` composes with it.

Departures: Δ_t is the sample-size weighted mean, as FedAvg's (Alg. 2: the plain mean over S); every floating-point
tensor of the state is stepped, BatchNorm's running statistics included, as the paper's and Flower's strategies do
with the whole model; integer buffers are the mean's, as FedAvg takes them. Flower's strategies of the same names
start v at 0, and its FedAdam also scales η by √(1 − β₂^{r+1}) / (1 − β₁^{r+1}) in server round r; the paper has
neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from plfl.fields import checked, one_of
from plfl.methods.fedavg import FedAvg, FedAvgConfig
from plfl.state import Params


@dataclass
class FedOptConfig(FedAvgConfig):
    """FedOpt's keys (Reddi et al., ICLR 2021, Alg. 2); defaults are the paper's β₁, β₂ and its commonly best τ.
    Derived from FedAvgConfig, so ``method.ala`` works here too."""

    server_optimizer: str = one_of(
        "adam", ("adam", "yogi", "adagrad"), "the server's optimiser: FedAdam, FedYogi or FedAdagrad"
    )
    server_lr: float = checked(0.01, lambda v: v > 0, "a number > 0", "η: the server's learning rate (tuned per task)")
    beta1: float = checked(0.9, lambda v: 0 <= v < 1, "a number in [0, 1)", "β₁: decay of the first moment m")
    beta2: float = checked(
        0.99, lambda v: 0 <= v < 1, "a number in [0, 1)", "β₂: decay of the second moment v (FedAdam, FedYogi)"
    )
    tau: float = checked(
        1e-3, lambda v: v > 0, "a number > 0", "τ: the adaptivity, added to √v; v starts at τ² (the paper's 1e-3)"
    )


def second_moment(optimizer: str, v: torch.Tensor, delta: torch.Tensor, beta2: float) -> torch.Tensor:
    """v_t from v_{t−1} and Δ_t by FedAdagrad's, FedYogi's or FedAdam's rule (Alg. 2), elementwise.

    Raises:
        ValueError: ``optimizer`` is not one of adam, yogi, adagrad.
    """
    square = delta * delta
    if optimizer == "adagrad":
        return v + square
    if optimizer == "yogi":
        return v - (1 - beta2) * square * torch.sign(v - square)
    if optimizer == "adam":
        return beta2 * v + (1 - beta2) * square
    raise ValueError(f"unknown server optimizer {optimizer!r}; expected adam, yogi or adagrad")


def adaptive_server_step(
    global_params: Params,
    average: Params,
    moments: Optional[dict[str, Params]],
    config: FedOptConfig,
) -> tuple[Params, dict[str, Params]]:
    """One server step of Alg. 2: Δ_t = x̄ − x_t, the moments' update, x_{t+1} = x_t + η m_t / (√v_t + τ).

    Args:
        global_params: x_t, the global model before the round.
        average: x̄, the weighted mean of the round's uploads (same keys and shapes), so Δ_t = x̄ − x_t.
        moments: {"m": m_{t−1}, "v": v_{t−1}} for the floating-point keys; None before the first step (m = 0, v = τ²).
        config: the optimiser and η, β₁, β₂, τ.

    Returns:
        (x_{t+1}, {"m": m_t, "v": v_t}). Integer buffers (e.g. BatchNorm's ``num_batches_tracked``) are x̄'s and have no
        moments.
    """
    params, first, second = {}, {}, {}
    for key, mean in average.items():
        if not mean.is_floating_point():
            params[key] = mean
            continue
        delta = mean - global_params[key]
        m, v = (
            (torch.zeros_like(delta), torch.full_like(delta, config.tau**2))
            if moments is None
            else (moments["m"][key], moments["v"][key])
        )
        first[key] = config.beta1 * m + (1 - config.beta1) * delta
        second[key] = second_moment(config.server_optimizer, v, delta, config.beta2)
        params[key] = global_params[key] + config.server_lr * first[key] / (second[key].sqrt() + config.tau)
    return params, {"m": first, "v": second}


class FedOpt(FedAvg):
    """FedOpt (Reddi et al., ICLR 2021): FedAvg's clients, an adaptive server optimiser (Adam, Yogi or Adagrad).

    The mean client update is the server's pseudo-gradient for FedAdam, FedYogi or FedAdagrad (Alg. 2).
    """

    name = "fedopt"
    config_class = FedOptConfig
    server_state = ("global_params", "moments")
    moments: Optional[dict[str, Params]] = None  # {"m": m_{t−1}, "v": v_{t−1}}; None until the first aggregation

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        previous = self.global_params
        super().aggregate(messages, round_)  # self.global_params = x̄, the weighted mean of the uploads
        self.global_params, self.moments = adaptive_server_step(previous, self.global_params, self.moments, self.config)
