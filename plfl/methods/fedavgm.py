"""FedAvgM (Hsu, Qi and Brown, 2019, arXiv:1909.06335): FedAvg with momentum on the server's update.

Sec. 4.2: with Θ^{t-1} the global model and Θ̄^t FedAvg's sample-size weighted mean of the
round's uploads, the server steps along the pseudo-gradient Δ^t = Θ^{t-1} − Θ̄^t with
heavy-ball momentum β and a server learning rate η_s (``method.server_momentum``,
``method.server_lr``); β = 0 and η_s = 1 is FedAvg. Only ``aggregate`` changes; the
velocity v is server state, saved in checkpoints. Departure: the paper's experiments
used Nesterov's variant of the momentum; this is the update as Sec. 4.2 writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from plfl.fields import checked
from plfl.methods.fedavg import FedAvg, FedAvgConfig
from plfl.state import Params


@dataclass
class FedAvgMConfig(FedAvgConfig):
    """FedAvgM's keys (Hsu et al., 2019, Sec. 4.2); β = 0 with η_s = 1 is FedAvg. Derived from
    FedAvgConfig, so ``method.ala`` works here too."""

    server_momentum: float = checked(
        0.9,
        lambda v: 0 <= v < 1,
        "a number in [0, 1)",
        "β: momentum of the server's update (the paper tried 0 to 0.997)",
    )
    server_lr: float = checked(
        1.0, lambda v: v > 0, "a number > 0", "η_s: the server's learning rate (the paper keeps it at 1)"
    )


def server_momentum_step(
    global_params: Params, average: Params, velocity: Optional[Params], momentum: float, lr: float
) -> tuple[Params, Params]:
    """One server step: Δ^t = Θ^{t-1} − Θ̄^t, v^t = β v^{t-1} + Δ^t, Θ^t = Θ^{t-1} − η_s v^t.

    Args:
        global_params: Θ^{t-1}, the global model of the previous round.
        average: Θ̄^t, FedAvg's weighted mean of the uploads (same keys and shapes).
        velocity: v^{t-1} for the floating-point keys; None before the first step (v^0 = 0).
        momentum: β in [0, 1).
        lr: η_s > 0.

    Returns:
        (Θ^t, v^t). Integer buffers (e.g. BatchNorm's ``num_batches_tracked``) are Θ̄^t's,
        as FedAvg takes them, and have no velocity.
    """
    params, new_velocity = {}, {}
    for key, mean in average.items():
        if not mean.is_floating_point():
            params[key] = mean
            continue
        previous = 0.0 if velocity is None else velocity[key]
        delta = global_params[key] - mean
        new_velocity[key] = momentum * previous + delta
        # Θ^{t-1} − η_s v^t, rearranged so that β = 0, η_s = 1 returns Θ̄^t exactly
        # (Θ^{t-1} − (Θ^{t-1} − Θ̄^t) can differ from Θ̄^t in the last bit).
        params[key] = mean + (1 - lr) * delta - lr * momentum * previous
    return params, new_velocity


class FedAvgM(FedAvg):
    """FedAvgM (Hsu et al., 2019): FedAvg with server momentum on the averaged update.

    FedAvg's clients and average; the server then takes a momentum step (Sec. 4.2).
    """

    name = "fedavgm"
    config_class = FedAvgMConfig
    server_state = ("global_params", "velocity")
    velocity: Optional[Params] = None  # v^{t-1}; None until the first aggregation

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        previous = self.global_params
        super().aggregate(messages, round_)  # self.global_params = Θ̄^t
        self.global_params, self.velocity = server_momentum_step(
            previous, self.global_params, self.velocity, self.config.server_momentum, self.config.server_lr
        )
