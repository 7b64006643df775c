r"""Self-FL (Chen et al., NeurIPS 2022): uncertainty-aware personalized federated learning.

"Self-Aware Personalized Federated Learning", arXiv:2204.08069, Sections 2–3 and Algorithm 1. The
paper's two-level Gaussian model (Eq. 1): :math:`\theta_m \sim N(\theta_0, \sigma_0^2)` across clients,
client m's local optimum :math:`z_m \sim N(\theta_m, \sigma_m^2)`. Precision weights
:math:`w_m = (\sigma_0^2 + \sigma_m^2)^{-1}` and :math:`W = \sum_m w_m` drive three rules: the leave-one-out
initialisation of local training (Eq. 9–10), the number of local steps
(Eq. 8/16) and the variance-weighted aggregation (Eq. 11). The variances are
estimated online from the uploaded models (Eq. 13–14).

Variances of multi-dimensional models are scalars: the per-coordinate sample
variance averaged over all floating-point coordinates (the paper's trace
divided by the number of coordinates; the rules only use ratios of
variances, so the scale does not matter).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from plfl.errors import ConfigError
from plfl.fields import checked, documented, one_of
from plfl.methods.base import FederationContext, Method, MethodConfig
from plfl.plots import Panel, Panels
from plfl.robust import weighted_average
from plfl.state import Params
from plfl.tasks import TrainResult, Work

# Scalars riding along with the models, as 0-dim float64 tensors (bytes are counted).
SIGMA_SQ = "selffl/sigma_sq"  # upload: σ_m² (NaN while the client has fewer than two uploads)
SIGMA0_SQ = "selffl/sigma0_sq"  # download: σ_0² (NaN until known)
TOTAL_WEIGHT = "selffl/total_weight"  # download: W = Σ_m w_m (NaN until known)
SCALARS = (SIGMA_SQ, SIGMA0_SQ, TOTAL_WEIGHT)


@dataclass
class SelfFLConfig(MethodConfig):
    """Self-FL's keys; the local learning rate η of Eq. 8 is ``federation.lr``."""

    init: str = one_of(
        "loo",
        ("loo", "global"),
        "start of local training: loo = global model without the client's share (Eq. 10), global = ablation",
    )
    l_min: int = checked(1, lambda v: v >= 1, "an integer >= 1", "lower clip of the local SGD steps l_m (Eq. 8)")
    l_max: int = checked(
        40, lambda v: v >= 1, "an integer >= 1", "upper clip of the local SGD steps l_m (paper: 40, Sec. 4.2)"
    )
    warmup_rounds: int = checked(
        2, lambda v: v >= 0, "an integer >= 0", "rounds of plain FedAvg before Self-FL's rules"
    )
    eps: float = checked(
        1e-10, lambda v: v > 0, "a number > 0", "floor of σ_m² and σ_0², so that the precisions stay finite"
    )
    # The ablation of the paper's Fig. 2b: each component can be replaced by FedAvg's.
    steps: str = one_of(
        "rule",
        ("rule", "fixed"),
        "local training length: rule = Eq. 8's l_m clipped to [l_min, l_max], fixed = federation.local_steps "
        "(or local_epochs) as the baselines train (ablation)",
    )
    aggregation: str = one_of(
        "variance",
        ("variance", "samples"),
        "weights of the round's uploads: variance = the precisions w_m (Eq. 11), samples = the clients' "
        "training-sample counts as FedAvg (ablation); both smoothed by C",
    )
    warmup_variance: bool = documented(
        True,
        "the warm-up rounds' uploads enter each client's σ_m² (Eq. 13); false: only uploads after the warm-up "
        "count, as the paper's warm start suggests (Sec. 3.2)",
    )


# ---- The math (pure functions; scalars are Python floats, models are Params) ----


def precision_weight(sigma0_sq: float, sigma_sq: float) -> float:
    """w_m = (σ_0² + σ_m²)⁻¹ (Self-FL, Eq. 2 and 11); variances in squared parameter units."""
    return 1.0 / (sigma0_sq + sigma_sq)


def leave_one_out(weight: float, total_weight: float) -> tuple[float, float]:
    """Client m's share w̃_m = w_m / W of the global model, and v_{-m} = 1 / (W − w_m),
    the posterior variance of θ_0 without client m (Self-FL, Eq. 2 without m, Eq. 9).

    Raises:
        ValueError: W ≤ w_m (no other client contributes).
    """
    if total_weight <= weight:
        raise ValueError(f"W = {total_weight} must exceed the client's own weight {weight}")
    return weight / total_weight, 1.0 / (total_weight - weight)


def loo_init(global_params: Params, personal: Params, share: float) -> Params:
    """INIT_m = (Θ^{t-1} − w̃_m Θ_m^{t-1}) / (1 − w̃_m): the global model with client m's
    share w̃_m ∈ [0, 1) removed (Self-FL, Eq. 9–10). Integer buffers come from the global model."""
    return {
        k: (g - share * personal[k]) / (1 - share) if g.is_floating_point() else g.clone()
        for k, g in global_params.items()
    }


def local_steps(sigma_sq: float, sigma0_sq: float, loo_variance: float, lr: float) -> int:
    """l_m = ⌈log(σ_m² / (σ_m² + σ_0² + v_{-m})) / log(1 − η)⌉ (Self-FL, Eq. 8, 16), at least 1, before the
    clip to [l_min, l_max].

    ``l`` gradient steps with rate η ∈ (0, 1) on ½(θ − z_m)² from INIT give
    (1 − (1−η)^l) z_m + (1−η)^l INIT (Eq. 6); this l makes (1−η)^l the
    posterior weight of the leave-one-out prior, σ_m² / (σ_m² + σ_0² + v_{-m}).
    """
    ratio = sigma_sq / (sigma_sq + sigma0_sq + loo_variance)
    # The tolerance keeps exact powers (ratio = (1−η)^k) at k despite rounding.
    return max(math.ceil(math.log(ratio) / math.log(1 - lr) - 1e-9), 1)


def welford_update(count: int, mean: Optional[Params], m2: Optional[Params], x: Params) -> tuple[int, Params, Params]:
    """One more observation ``x`` in per-coordinate running statistics (Welford; Self-FL, Eq. 13–14, App. E).

    ``mean`` and ``m2`` (sum of squared deviations) are shaped like ``x``'s
    floating-point tensors, None when ``count`` is 0. Returns new tensors.
    """
    x = floating(x)
    if count == 0:
        return 1, {k: v.clone() for k, v in x.items()}, {k: torch.zeros_like(v) for k, v in x.items()}
    count += 1
    new_mean = {k: mean[k] + (v - mean[k]) / count for k, v in x.items()}
    new_m2 = {k: m2[k] + (v - mean[k]) * (v - new_mean[k]) for k, v in x.items()}
    return count, new_mean, new_m2


def welford_variance(count: int, m2: Optional[Params]) -> float:
    """The sample variance (n − 1 denominator) of each coordinate, averaged over all coordinates;
    NaN for fewer than two observations."""
    if count < 2:
        return math.nan
    total = sum(v.sum(dtype=torch.float64).item() for v in m2.values())
    return total / ((count - 1) * sum(v.numel() for v in m2.values()))


def across_variance(models: list[Params]) -> float:
    """σ_0² before flooring: the variance of ``models`` across clients, per coordinate, averaged
    over coordinates (Self-FL, Eq. 14); NaN for fewer than two models."""
    count, mean, m2 = 0, None, None
    for model in models:
        count, mean, m2 = welford_update(count, mean, m2, model)
    return welford_variance(count, m2)


def smooth(previous: Params, estimate: Params, rate: float) -> Params:
    """Θ^t = (1 − C) Θ^{t-1} + C Θ̂^t, C the client activity rate (Self-FL, Sec. 4.1)."""
    return weighted_average([previous, estimate], [1 - rate, rate])


def floating(params: Params) -> Params:
    """The floating-point tensors of ``params`` (the coordinates whose variances are estimated)."""
    return {k: v for k, v in params.items() if v.is_floating_point()}


def scalar(value: Optional[float]) -> torch.Tensor:
    """A 0-dim float64 tensor to send; None becomes NaN ("not known yet")."""
    return torch.tensor(math.nan if value is None else value, dtype=torch.float64)


def known(value: torch.Tensor) -> Optional[float]:
    """The float in a received 0-dim tensor, None for NaN."""
    value = value.item()
    return None if math.isnan(value) else value


class SelfFL(Method):
    r"""Self-FL (Chen et al., NeurIPS 2022): uncertainty-aware init, steps and aggregation.

    Leave-one-out initialisation, variance-driven local steps and aggregation.

    Client m in round t (``local_train``): from what it received last
    (:math:`\Theta^{t-1}, \sigma_0^2, W`) and its own :math:`\sigma_m^2`,
    :math:`w_m = (\sigma_0^2 + \sigma_m^2)^{-1}`, :math:`\tilde w_m = w_m / W`,
    :math:`v_{-m} = 1 / (W - w_m)`; it trains :math:`l_m` SGD steps (Eq. 8, clipped to
    :math:`[l_{min}, l_{max}]`, :math:`\eta` = ``federation.lr``) from :math:`INIT_m` (Eq. 10, its latest
    personal model :math:`\Theta_m^{t-1}`; ``init: global`` starts from :math:`\Theta^{t-1}`). It then
    adds the trained :math:`\Theta_m^t` to its running per-coordinate statistics (Welford)
    and uploads :math:`\Theta_m^t` with :math:`\sigma_m^2` (Eq. 13), floored at ``eps``.

    Server (``aggregate``): :math:`\sigma_0^2` is the across-client variance of the round's
    uploads (Eq. 14, floored at ``eps``);
    :math:`\hat\Theta^t = \sum_{S_t} w_m \Theta_m^t / \sum_{S_t} w_m` (Eq. 11), smoothed as
    :math:`\Theta^t = (1 - C) \Theta^{t-1} + C \hat\Theta^t` with C =
    ``federation.join_ratio``. W sums :math:`w_m` over all clients, a client without a
    :math:`\sigma_m^2` yet counted with the mean of the known ones, so that :math:`\tilde w_m` ≈ client
    m's share in the smoothed global model and :math:`v_{-m}` is Eq. 2's posterior
    variance over the whole population. It downloads :math:`\Theta^t`, :math:`\sigma_0^2` and W.

    Warm-up: rounds 1..``warmup_rounds`` are plain FedAvg (training from
    Θ^{t-1} for ``federation.local_epochs`` epochs, sample-size weights), and
    so is a client's training while it has uploaded fewer than twice (its σ_m²
    is undefined) or no other client is known (W = w_m); the statistics
    accumulate meanwhile. The aggregation stays FedAvg until σ_0² and some
    σ_m² are known. (The first Self-FL initialisation removes w̃_m Θ_m from
    a FedAvg average, an approximation for that one round.)

    Ablation (the paper's Fig. 2b): ``steps: fixed`` trains ``federation.local_steps`` in place of l_m,
    ``aggregation: samples`` weighs the uploads by training samples in place of w_m (still smoothed by C),
    ``init: global`` starts from Θ^{t-1}; each alone replaces one component by FedAvg's.
    ``warmup_variance: false`` leaves the warm-up's uploads out of σ_m².

    Evaluated model: the client's personalized model, its latest trained Θ_m
    (the paper's Fig. 3); ``pre_local_init`` returns it (Θ^{t-1} for a client
    that never trained); ``local_train`` computes INIT_m from the message the
    client received. The global model Θ^t is evaluated on the union of the
    test splits.
    """

    name = "selffl"
    not_averaging = "weights client models by the precision it estimates of each"
    config_class = SelfFLConfig
    figures = (
        Panels(
            "Self-FL: variances and local steps",
            (
                Panel("selffl_sigma0_sq", "σ₀² (inter-client variance)", log=True),
                Panel(
                    "selffl_sigma_sq_mean",
                    "σ_m² (clients; line: mean)",
                    log=True,
                    points=("selffl_clients", "sigma_sq"),
                ),
                Panel(
                    "selffl_local_steps_mean", "l_m (local steps; line: mean)", points=("selffl_clients", "local_steps")
                ),
            ),
        ),
    )
    # The executor matrix: past its warm-up within the matrix's 3 rounds.
    matrix_options = {"method.warmup_rounds": 1, "method.l_max": 5}
    server_state = ("global_params", "sigma0_sq", "sigma_sq", "total_weight", "trained")

    def __init__(self, config: SelfFLConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        if not 0 < context.federation.lr < 1:
            raise ConfigError(
                f"Self-FL's step rule (Eq. 8) needs federation.lr in (0, 1); got {context.federation.lr}."
            )
        if config.l_min > config.l_max:
            raise ConfigError(f"method.l_min ({config.l_min}) must not exceed method.l_max ({config.l_max}).")
        self.sigma0_sq: Optional[float] = None
        self.sigma_sq: dict[int, float] = {}  # client → its latest uploaded σ_m² (server side)
        self.total_weight: Optional[float] = None
        self.trained: list[int] = []  # the clients that uploaded in the last round

    # ---- client side ----

    def server_message(self, client_id: int, round_: int) -> Params:
        """Θ^{t-1} with the two scalars σ_0² and W (what is sent, and so counted)."""
        return {**self.global_params, SIGMA0_SQ: scalar(self.sigma0_sq), TOTAL_WEIGHT: scalar(self.total_weight)}

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Params:
        """The client's personal Θ_m (the received Θ^{t-1} before its first training)."""
        if not self.store.get(client_id, "selffl_trained", False):
            return {k: v.clone() for k, v in message.items() if k not in SCALARS}
        return self.store.get(client_id, "model")

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """l_m SGD steps from INIT_m (FedAvg's epochs from Θ^{t-1} in the warm-up), then update σ_m²;
        ``message``: Θ^{t-1}, σ_0² and W as received."""
        global_params = {k: v for k, v in message.items() if k not in SCALARS}
        plan = self.plan(client_id, message, round_)
        if plan is None:
            result = yield from super().local_train(client_id, global_params, message, round_)
        else:
            share, rule_steps = plan
            start = loo_init(global_params, params, share) if self.config.init == "loo" else global_params
            length = (
                {"steps": self.clipped(rule_steps)}
                if self.config.steps == "rule"
                else self.context.federation.local_length()
            )
            result = yield self.train_task(client_id, start, round_, "local_training", **length)
        self.store.set(client_id, "selffl_trained", True)
        self.store.set(client_id, "selffl_rule_steps", None if plan is None else plan[1])
        self.store.set(client_id, "selffl_steps", None if plan is None else length.get("steps"))
        if round_ <= self.config.warmup_rounds and not self.config.warmup_variance:
            return result
        count, mean, m2 = welford_update(
            self.store.get(client_id, "selffl_count", 0),
            self.store.get(client_id, "selffl_mean"),
            self.store.get(client_id, "selffl_m2"),
            result.params,
        )
        self.store.set(client_id, "selffl_count", count)
        self.store.set(client_id, "selffl_mean", mean)
        self.store.set(client_id, "selffl_m2", m2)
        variance = welford_variance(count, m2)
        self.store.set(client_id, "selffl_sigma_sq", None if math.isnan(variance) else max(variance, self.config.eps))
        return result

    def private_steps(self, steps: Callable[[dict[str, float]], int], rounds: int) -> int:
        """With ``steps: rule``, a round after the warm-up trains l_max steps at most, or FedAvg's length where
        it has no plan yet (:meth:`plan`): the longer of the two in each of those rounds."""
        total = super().private_steps(steps, rounds)
        if self.config.steps == "rule":
            extra = steps({"steps": self.config.l_max}) - steps(self.context.federation.local_length())
            total += max(0, rounds - self.config.warmup_rounds) * max(0, extra)
        return total

    def clipped(self, rule_steps: int) -> int:
        """The local steps trained: Eq. 8's l_m clipped to [l_min, l_max]."""
        return min(max(rule_steps, self.config.l_min), self.config.l_max)

    def plan(self, client_id: int, received: Params, round_: int) -> Optional[tuple[float, int]]:
        """(w̃_m, l_m before the clip) for Self-FL training in ``round_``, or None for FedAvg-style training."""
        sigma_sq = self.store.get(client_id, "selffl_sigma_sq")
        sigma0_sq, total_weight = known(received[SIGMA0_SQ]), known(received[TOTAL_WEIGHT])
        if round_ <= self.config.warmup_rounds or None in (sigma_sq, sigma0_sq, total_weight):
            return None
        weight = precision_weight(sigma0_sq, sigma_sq)
        if total_weight <= weight:
            return None
        share, loo_variance = leave_one_out(weight, total_weight)
        return share, local_steps(sigma_sq, sigma0_sq, loo_variance, self.context.federation.lr)

    def client_message(self, client_id: int, result: TrainResult, round_: int) -> Params:
        return {**result.params, SIGMA_SQ: scalar(self.store.get(client_id, "selffl_sigma_sq"))}

    # ---- server side ----

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        models = {i: {k: v for k, v in m.items() if k != SIGMA_SQ} for i, m in messages.items()}
        for client_id, message in messages.items():
            if (sigma_sq := known(message[SIGMA_SQ])) is not None:
                self.sigma_sq[client_id] = sigma_sq
        if len(models) >= 2:
            self.sigma0_sq = max(across_variance(list(models.values())), self.config.eps)
        self.trained = list(messages)
        weights = self.population_weights()
        self.total_weight = None if weights is None else sum(weights)
        if round_ <= self.config.warmup_rounds or weights is None:
            sizes = [self.context.data.clients[i].num_train for i in models]
            self.global_params = weighted_average(list(models.values()), sizes)
        else:
            sizes = [self.context.data.clients[i].num_train for i in models]
            variance = self.config.aggregation == "variance"
            estimate = weighted_average(list(models.values()), [weights[i] for i in models] if variance else sizes)
            self.global_params = smooth(self.global_params, estimate, self.context.federation.join_ratio)

    def population_weights(self) -> Optional[list[float]]:
        """w_m of every client, one without a known σ_m² counted with their mean;
        None until σ_0² and some σ_m² are known."""
        if self.sigma0_sq is None or not self.sigma_sq:
            return None
        mean = sum(self.sigma_sq.values()) / len(self.sigma_sq)
        return [precision_weight(self.sigma0_sq, self.sigma_sq.get(i, mean)) for i in range(len(self.store))]

    def global_model(self, round_: int) -> Params:
        return self.global_params

    def round_metrics(self, round_: int) -> dict[str, float]:
        """σ_0², the trained clients' mean σ_m², the mean of their local steps as trained by Self-FL's rules (l_m
        clipped; ``steps: fixed``: ``federation.local_steps``), and the median of Eq. 8's l_m before the clip
        (``selffl_rule_steps_median``: above ``method.l_max`` when the cap binds)."""
        metrics = {} if self.sigma0_sq is None else {"selffl_sigma0_sq": self.sigma0_sq}
        sigmas = [s for i in self.trained if (s := self.store.get(i, "selffl_sigma_sq")) is not None]
        rule_steps = [s for i in self.trained if (s := self.store.get(i, "selffl_rule_steps")) is not None]
        steps = [s for i in self.trained if (s := self.store.get(i, "selffl_steps")) is not None]
        if sigmas:
            metrics["selffl_sigma_sq_mean"] = sum(sigmas) / len(sigmas)
        if steps:
            metrics["selffl_local_steps_mean"] = sum(steps) / len(steps)
        if rule_steps:
            metrics["selffl_rule_steps_median"] = statistics.median(rule_steps)
        return metrics

    def round_tables(self, round_: int) -> dict[str, list[dict[str, Any]]]:
        """σ_m² and l_m of the clients that trained this round (empty cells: not defined yet / warm-up)."""
        if round_ == 0:
            return {}
        rows = []
        for i in self.trained:
            rows.append(
                {
                    "client": i,
                    "uploads": self.store.get(i, "selffl_count"),
                    "sigma_sq": self.store.get(i, "selffl_sigma_sq"),
                    "local_steps": self.store.get(i, "selffl_steps"),
                    "rule_steps": self.store.get(i, "selffl_rule_steps"),
                }
            )
        return {"selffl_clients": rows}
