"""Adaptive Local Aggregation (ALA), the local initialisation of FedALA.

Zhang et al., "FedALA: Adaptive Local Aggregation for Personalized Federated
Learning", AAAI 2023, Eq. 3–5 and Algorithm 1 (lines 6–16). ALA is a
component: any method can switch it on with ``method.ala: {...}``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from plfl.errors import ConfigError, PlflWarning
from plfl.methods.schemas import ALAConfig
from plfl.models import BodyHeadModel
from plfl.state import Params

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class ALAOutcome:
    """The initialised local model, the updated weights W_i, and how many epochs ALA ran."""

    params: Params
    weights: Params  # W_i: name → tensor in [0, 1], shaped like the top-p parameters
    epochs: int


class AdaptiveLocalAggregation:
    """Learns element-wise weights W_i that mix the global and the old local model.

    With Θ the global model, Θ_i the client's old local model and the top p
    parameter tensors (in ``named_parameters`` order, counted from the end):

    - lower tensors: Θ̂ = Θ (Eq. 4);
    - top tensors: Θ̂ = Θ_i + (Θ − Θ_i) ⊙ W_i (Eq. 3);
    - per mini-batch of an s % sample of D_i:
      W_i ← clamp(W_i − η · ∇_Θ̂ L(Θ̂) ⊙ (Θ − Θ_i), 0, 1) (Eq. 5), then recompute Θ̂.

    The first time it runs for a client (W_i absent: the "initial stage") it
    repeats epochs until more than ``num_pre_loss`` epoch losses are recorded
    and the std of the last ``num_pre_loss`` is below ``threshold`` (the
    recorded loss is each epoch's last batch loss), at most ``max_init_epochs``;
    afterwards exactly one epoch.
    """

    def __init__(self, config: ALAConfig, model: nn.Module, batch_size: int):
        self.config = config
        self.model = model  # architecture only: parameters are supplied per call
        self.batch_size = batch_size
        self.top = top_names(model, config.p)

    def __call__(
        self,
        global_params: Params,
        local_params: Params,
        weights: Optional[Params],
        x: torch.Tensor,
        y: torch.Tensor,
        generator: torch.Generator,
        client_id: int,
    ) -> ALAOutcome:
        """Initialise client ``client_id``'s model from the global and its old local model.

        Args:
            global_params / local_params: Θ and Θ_i (not modified).
            weights: W_i from the client's last ALA, or None before its first (initial stage).
            x: (n, *input_shape) training inputs, y: (n,) labels of the client.
            generator: draws the s % sample.

        Warns:
            PlflWarning: the initial stage hit ``max_init_epochs`` before the losses settled.
        """
        cfg = self.config
        initial_stage = weights is None
        weights = {k: torch.ones_like(global_params[k]) for k in self.top} if initial_stage else dict(weights)
        gap = {k: global_params[k] - local_params[k] for k in self.top}
        self.model.train()
        inputs, forward = self._forward(global_params, self._sample_batches(x, y, generator))

        def mixed() -> Params:
            return {k: (local_params[k] + gap[k] * weights[k]).requires_grad_() for k in self.top}

        theta = mixed()
        losses: list[float] = []
        while True:
            for inp, target in inputs:
                loss = F.cross_entropy(forward(inp, theta), target)
                grads = torch.autograd.grad(loss, [theta[k] for k in self.top])
                for k, g in zip(self.top, grads):
                    weights[k] = torch.clamp(weights[k] - cfg.eta * g * gap[k], 0, 1)
                theta = mixed()
            losses.append(loss.item())
            if not initial_stage or settled(cfg, losses):
                break
            if len(losses) >= cfg.max_init_epochs:
                warn_capped(cfg, client_id, losses)
                break
        params = {k: v.clone() for k, v in global_params.items()}
        params.update({k: theta[k].detach() for k in self.top})
        return ALAOutcome(params, weights, len(losses))

    def _forward(self, global_params: Params, batches: list[Batch]) -> tuple[list[Batch], Callable]:
        """The per-batch inputs and ``forward(input, top tensors) → logits`` with the rest fixed to Θ.

        When only head tensors are aggregated, the body is the fixed global body
        in every epoch, so its features are computed once per batch and the
        epochs run the head alone: the same numbers at a fraction of the cost.
        Buffers are copied so that BatchNorm statistics updated here are discarded.
        """
        fixed = {k: v.clone() for k, v in global_params.items() if k not in self.top}
        if not head_only(self.model, self.top):
            return batches, lambda inp, theta: functional_call(self.model, {**fixed, **theta}, (inp,))
        body, head = _submodule_params(fixed, "body."), _submodule_params(fixed, "head.")
        with torch.no_grad():
            features = [(functional_call(self.model.body, body, (xb,)), yb) for xb, yb in batches]
        return features, lambda inp, theta: functional_call(
            self.model.head, {**head, **_submodule_params(theta, "head.")}, (inp,)
        )

    def _sample_batches(
        self, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator
    ) -> list[Batch]:
        """The s % sample of (x, y), in data order, cut into mini-batches (the same every epoch)."""
        index = sample_index(len(y), self.config.s, generator)
        xs, ys = x[index], y[index]
        return [(xs[i:i + self.batch_size], ys[i:i + self.batch_size]) for i in range(0, len(index), self.batch_size)]


def top_names(model: nn.Module, p: int) -> list[str]:
    """The names of the top ``p`` parameter tensors (``named_parameters`` order, counted from the end).

    Raises:
        ConfigError: the model has fewer than ``p`` parameter tensors.
    """
    names = [name for name, _ in model.named_parameters()]
    if p > len(names):
        raise ConfigError(f"ALA p={p} exceeds the model's {len(names)} parameter tensors; lower p.")
    return names[-p:]


def head_only(model: nn.Module, top: list[str]) -> bool:
    """Whether ALA aggregates head tensors only, so that the body is the fixed global body in every epoch."""
    return isinstance(model, BodyHeadModel) and all(k.startswith("head.") for k in top)


def sample_index(n: int, s: float, generator: torch.Generator) -> torch.Tensor:
    """(max(1, ⌊s/100 · n⌋),) int64: the s % sample of n training samples that ALA learns on, in data order."""
    count = max(1, int(s / 100 * n))
    return torch.randperm(n, generator=generator)[:count].sort().values


def settled(config: ALAConfig, losses: list[float]) -> bool:
    """Whether the initial stage ends: more than ``num_pre_loss`` epoch losses, the std of the last ones below
    ``threshold``."""
    n = config.num_pre_loss
    return len(losses) > n and float(np.std(losses[-n:])) < config.threshold


def warn_capped(config: ALAConfig, client_id: int, losses: list[float]) -> None:
    """Warn that client ``client_id``'s initial stage hit ``max_init_epochs`` before its ``losses`` settled."""
    warnings.warn(
        f"ALA's initial stage for client {client_id} stopped at method.max_init_epochs={config.max_init_epochs} "
        f"epochs before its loss settled (std of the last {config.num_pre_loss} epoch losses "
        f"{np.std(losses[-config.num_pre_loss:]):.4f} >= threshold {config.threshold}). "
        "Raise method.threshold or method.max_init_epochs.",
        PlflWarning,
        stacklevel=2,
    )


def _submodule_params(params: Params, prefix: str) -> Params:
    return {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}
