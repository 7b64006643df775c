"""Aggregation rules robust to Byzantine clients, over client models given as parameter dicts.

Every rule takes the clients' states (``Params``: name → tensor, the same names and shapes in each), their
weights (e.g. training samples) and returns one state. Only floating-point tensors are combined by the rule;
integer buffers (e.g. BatchNorm's counter) are taken as :func:`weighted_average` takes them, from the first
state. Krum's distances are taken over all floating-point tensors together, flattened into one vector.

The coordinate-wise median and trimmed mean and Krum are translation-invariant (shifting every state by the
same vector shifts the result by it), so they apply to the models themselves, as to the updates θ_i − θ_sent;
norm bounding is not, and takes the model the server sent (``sent``) as the reference of the updates.
"""

from __future__ import annotations

import math

import torch

from plfl.sections import AggregationConfig
from plfl.state import Params


def robust_average(states: list[Params], weights: list[float], sent: Params, rule: AggregationConfig) -> Params:
    """The clients' ``states`` (weights ``weights``, e.g. training samples) combined by ``rule.rule``
    (``aggregation.*``): ``mean`` is :func:`weighted_average`; ``sent`` is the model the clients started from,
    the reference of ``norm_bound``'s updates (the other rules are translation-invariant and ignore it).

    Raises:
        ValueError: the rule's own errors (too few states for Krum, ...).
    """
    if rule.rule == "mean":
        return weighted_average(states, weights)
    if rule.rule == "median":
        return coordinate_median(states)
    if rule.rule == "trimmed_mean":
        return trimmed_mean(states, rule.trim)
    if rule.rule in ("krum", "multi_krum"):
        return krum(states, weights, rule.byzantine, rule.selected if rule.rule == "multi_krum" else 1)
    if rule.rule == "norm_bound":
        return norm_bounded_mean(states, weights, sent, rule.max_norm)
    raise ValueError(f"unknown aggregation rule {rule.rule!r}")


def weighted_average(states: list[Params], weights: list[float]) -> Params:
    """Σ_i w_i θ_i / Σ_i w_i per tensor; integer buffers (e.g. BatchNorm's counter) come from the first state.

    Raises:
        ValueError: no states, or weights that do not sum to a positive number.
    """
    total = float(sum(weights))
    if not states or total <= 0:
        raise ValueError(f"cannot average {len(states)} states with weights summing to {total}")
    averaged = {}
    for key, first in states[0].items():
        if first.is_floating_point():
            averaged[key] = sum(w / total * s[key] for w, s in zip(weights, states))
        else:
            averaged[key] = first.clone()
    return averaged


def coordinate_median(states: list[Params]) -> Params:
    """The coordinate-wise median (Yin et al., *Byzantine-Robust Distributed Learning*, ICML 2018, Option I):
    per scalar of every floating-point tensor, the median over the n states (for even n the mean of the two
    middle values). Unweighted, as in the paper.

    Raises:
        ValueError: no states.
    """
    _require(states, 1, "the coordinate-wise median")
    n = len(states)

    def median(stacked: torch.Tensor) -> torch.Tensor:  # (n, ...) → (...)
        ordered = stacked.sort(dim=0).values
        return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2

    return _per_tensor(states, median)


def trimmed_mean(states: list[Params], trim: float) -> Params:
    """The coordinate-wise β-trimmed mean (Yin et al., ICML 2018, Option II): per scalar, the mean of the n values
    left after dropping the ⌊β n⌋ largest and the ⌊β n⌋ smallest. Unweighted, as in the paper.

    Raises:
        ValueError: no states, or β outside [0, 0.5).
    """
    if not 0 <= trim < 0.5:
        raise ValueError(f"the trimmed mean drops a fraction in [0, 0.5) at each end, not {trim}; lower the trim")
    _require(states, 1, "the trimmed mean")
    n = len(states)
    cut = math.floor(trim * n)
    return _per_tensor(states, lambda stacked: stacked.sort(dim=0).values[cut : n - cut].mean(dim=0))


def krum_scores(states: list[Params], byzantine: int) -> torch.Tensor:
    """Krum's score of each state (Blanchard et al., *Machine Learning with Adversaries: Byzantine Tolerant
    Gradient Descent*, NeurIPS 2017, Sec. 4): s(i) = Σ ‖θ_i − θ_j‖² over the n − f − 2 states j ≠ i closest to
    θ_i; float64, shape (n,).

    Raises:
        ValueError: fewer than 2f + 3 states (the paper's n > 2f + 2).
    """
    _require(states, 2 * byzantine + 3, f"Krum with f={byzantine} Byzantine clients (n > 2f + 2)")
    keys = [k for k, v in states[0].items() if v.is_floating_point()]
    points = torch.stack([torch.cat([s[k].detach().reshape(-1).double() for k in keys]) for s in states])
    squared = torch.cdist(points, points).square()
    nearest = len(states) - byzantine - 2
    # Each row's smallest value is the point's distance to itself (0), left out.
    return squared.sort(dim=1).values[:, 1 : 1 + nearest].sum(dim=1)


def krum(states: list[Params], weights: list[float], byzantine: int, selected: int = 1) -> Params:
    """Krum (``selected`` = 1: the state of the lowest :func:`krum_scores`) or Multi-Krum (the weighted mean of
    the ``selected`` = m states of lowest scores; Blanchard et al. average them plainly, which equal weights
    give). Ties go to the lower index.

    Raises:
        ValueError: fewer than 2f + 3 states, or m outside [1, n].
    """
    scores = krum_scores(states, byzantine)
    if not 1 <= selected <= len(states):
        raise ValueError(
            f"Multi-Krum averages m of the n={len(states)} models, so m must be in [1, n]; got m={selected}. "
            "Lower aggregation.selected or sample more clients."
        )
    best = torch.argsort(scores, stable=True)[:selected].tolist()
    return weighted_average([states[i] for i in best], [weights[i] for i in best])


def norm_bounded_mean(states: list[Params], weights: list[float], sent: Params, bound: float) -> Params:
    """Norm bounding (Sun et al., *Can You Really Backdoor Federated Learning?*, 2019): each update
    u_i = θ_i − θ_sent scaled to u_i / max(1, ‖u_i‖₂ / M), the norm over all its floating-point tensors, then
    θ_sent + Σ_i w_i u_i / Σ_i w_i.

    Raises:
        ValueError: no states, weights that do not sum to a positive number, or M ≤ 0.
    """
    if bound <= 0:
        raise ValueError(f"norm bounding clips updates to a norm M > 0, not {bound}; raise the bound")
    _require(states, 1, "norm bounding")
    keys = [k for k, v in states[0].items() if v.is_floating_point()]
    clipped = []
    for state in states:
        update = {k: state[k] - sent[k] for k in keys}
        norm = torch.sqrt(sum(u.double().square().sum() for u in update.values())).item()
        factor = 1 / max(1.0, norm / bound)
        clipped.append({**state, **{k: sent[k] + factor * u for k, u in update.items()}})
    return weighted_average(clipped, weights)


def _per_tensor(states: list[Params], combine) -> Params:
    """``combine`` of the stacked (n, ...) floating-point tensors of every name; integer ones from the first
    state."""
    return {
        key: combine(torch.stack([s[key] for s in states])) if first.is_floating_point() else first.clone()
        for key, first in states[0].items()
    }


def _require(states: list[Params], least: int, rule: str) -> None:
    if len(states) < least:
        raise ValueError(
            f"{rule} needs at least {least} client models, got {len(states)}; sample more clients per round "
            "(federation.join_ratio) or relax the rule"
        )
