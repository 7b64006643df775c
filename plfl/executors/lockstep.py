"""Lock-step schedules and stacked states of the vectorized executor, and the models it runs exactly.

A client's work is a (S, W) table of sample indices, one row per step, with
-1 padding a short batch. Stacked for a cohort of clients sorted by S
(longest first), the clients still working at step s are the first
``active[s]``, so a finished client costs nothing and the shapes of a step
depend only on how many are active.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torchvision.models.resnet import BasicBlock, ResNet

from plfl.models import BodyHeadModel
from plfl.models.networks import ConditionalValve, ValvedBody, ValvedModel
from plfl.state import Params

# Layers that vmap runs exactly (BatchNorm through MaskedBatchNorm), torchvision's ResNet-18 included.
SUPPORTED = (
    BodyHeadModel,
    ValvedModel,
    ValvedBody,
    ConditionalValve,
    nn.Sequential,
    nn.Linear,
    nn.Conv2d,
    nn.ReLU,
    nn.MaxPool2d,
    nn.Flatten,
    nn.Identity,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.AdaptiveAvgPool2d,
    nn.LayerNorm,
    nn.Embedding,
    ResNet,
    BasicBlock,
)


def unsupported(model: nn.Module, precision: str) -> Optional[str]:
    """Why the vectorized executor cannot run ``model`` exactly at ``precision``; None if it can."""
    if precision != "32-true":
        return f"trainer.precision={precision} (it computes in float32 only)"
    for module in model.modules():
        if type(module) not in SUPPORTED:
            return f"the model has a {type(module).__name__} layer"
    return None


class MaskedBatchNorm(nn.Module):
    """A BatchNorm layer for the lock-step schedule, with the state (names and values) of the one it replaces.

    In training mode its batch statistics count only the samples where ``mask`` ((W,) 0/1, set by
    :func:`masked` for each call) is 1, so a padded short batch normalises as the real samples alone would;
    it computes the running statistics that torch's BatchNorm would write (momentum, or the cumulative average
    when momentum is None; the unbiased variance) and leaves them in ``update`` instead: under ``vmap`` they
    can leave the function only as its output. In evaluation mode it uses the running statistics.
    """

    def __init__(self, norm: _BatchNorm):
        super().__init__()
        self.eps, self.momentum = norm.eps, norm.momentum
        self.weight, self.bias = norm.weight, norm.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            self.register_buffer(name, getattr(norm, name))
        self.mask: Optional[torch.Tensor] = None
        self.update: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (W, C) or ``(W, C, *spatial)`` → the same shape."""
        shape = (1, -1) + (1,) * (x.dim() - 2)
        if self.training or self.running_mean is None:
            mask = x.new_ones(len(x)) if self.mask is None else self.mask
            m = mask.view(-1, *(1,) * (x.dim() - 1))
            dims = [d for d in range(x.dim()) if d != 1]
            count = mask.sum() * x[0, 0].numel()  # real samples × spatial positions
            mean = (x * m).sum(dims) / count
            var = ((x - mean.view(shape)).pow(2) * m).sum(dims) / count
            if self.training and self.running_mean is not None:
                tracked = self.num_batches_tracked + 1
                rate = 1.0 / tracked if self.momentum is None else self.momentum
                unbiased = var.detach() * count / (count - 1)
                self.update = (
                    self.running_mean * (1 - rate) + mean.detach() * rate,
                    self.running_var * (1 - rate) + unbiased * rate,
                    tracked,
                )
        else:
            mean, var = self.running_mean, self.running_var
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return y if self.weight is None else y * self.weight.view(shape) + self.bias.view(shape)


def with_masked_batch_norms(model: nn.Module) -> nn.Module:
    """``model`` with each BatchNorm layer replaced by a :class:`MaskedBatchNorm` (in place; give a copy)."""
    for module in list(model.modules()):
        for child_name, child in module.named_children():
            if isinstance(child, _BatchNorm):
                setattr(module, child_name, MaskedBatchNorm(child))
    return model


def masked_batch_norms(model: nn.Module) -> list[tuple[str, MaskedBatchNorm]]:
    """``model``'s MaskedBatchNorm layers with their names (found once, not at every step)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MaskedBatchNorm)]


@contextmanager
def masked(norms: list[tuple[str, MaskedBatchNorm]], mask: torch.Tensor) -> Iterator[dict[str, torch.Tensor]]:
    """Within the block, the layers ``norms`` (:func:`masked_batch_norms`) count the samples of the (W,) 0/1
    ``mask``; yields a dict that, at the block's end, holds the running statistics they computed (by state-dict
    name)."""
    for _, norm in norms:
        norm.mask = mask
    statistics: dict[str, torch.Tensor] = {}
    try:
        yield statistics
    finally:
        for name, norm in norms:
            if norm.update is not None:
                for key, value in zip(("running_mean", "running_var", "num_batches_tracked"), norm.update):
                    statistics[f"{name}.{key}" if name else key] = value
            norm.mask = norm.update = None


@dataclass
class Split:
    """Every client's samples of one split, concatenated on one device: client i holds rows
    ``offsets[i] : offsets[i] + sizes[i]`` of ``x`` ``(N, *input_shape)`` and ``y`` (N,)."""

    x: torch.Tensor
    y: torch.Tensor
    offsets: list[int]
    sizes: list[int]

    @classmethod
    def of(cls, parts: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> Split:
        sizes = [len(y) for _, y in parts]
        offsets = torch.tensor([0, *sizes]).cumsum(0)[:-1].tolist()
        return cls(
            torch.cat([x for x, _ in parts]).to(device), torch.cat([y for _, y in parts]).to(device), offsets, sizes
        )

    def schedule(self, offsets: list[int], rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """For a cohort whose member c reads the rows from ``offsets[c]`` on, with ``rows[c]`` (S_c, W) in
        non-increasing S_c: the (S, C, W) int64 indices into ``x``, the (S, C, W) float mask of real samples
        (padding: some valid index, mask 0), and how many members are active at each step."""
        steps, width = rows[0].shape
        index = torch.zeros(steps, len(rows), width, dtype=torch.long)
        mask = torch.zeros(steps, len(rows), width)
        for c, (offset, r) in enumerate(zip(offsets, rows)):
            index[: len(r), c] = r.clamp(min=0) + offset
            mask[: len(r), c] = r >= 0
        lengths = torch.tensor([len(r) for r in rows])
        active = (lengths > torch.arange(steps).unsqueeze(1)).sum(1).tolist()
        device = self.x.device
        return index.to(device), mask.to(device), active


class CohortState:
    """Stacked states of up to ``capacity`` clients in tensors that outlive a cohort, so that a step recorded for
    one cohort (:class:`~plfl.executors.step_graphs.StepGraphs`) serves the next: row c of each tensor is
    member c's.

    ``state``: name → ``(capacity, *shape)`` for every tensor of ``template`` (a client's state dict);
    ``velocity``: the SGD momentum buffer of each parameter in ``parameters`` (when ``momentum``);
    ``anchor``: the proximal term's anchor of each parameter (allocated by the first :meth:`load` that has
    one); ``loss_sum``: (capacity,) float32 summed losses; ``correct``: (capacity,) float32 correct
    predictions (evaluation); :meth:`batch`: the current step's samples.
    """

    def __init__(self, template: Params, parameters: list[str], capacity: int, device: torch.device, momentum: bool):
        self.capacity, self.parameters, self.device = capacity, parameters, device
        self.state = zero_rows(template, capacity, device)
        self.velocity = {k: torch.zeros_like(self.state[k]) for k in parameters} if momentum else {}
        self.anchor: Params = {}
        self.loss_sum, self.correct = torch.zeros(2, capacity, device=device)
        self.batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def load(self, states: list[Params], anchors: Optional[list[Params]] = None) -> None:
        """Rows 0..len(states)-1 ← the clients' states (and proximal anchors); velocity, losses and counts ← 0."""
        copy_rows(self.state, states)
        if anchors is not None:
            self.anchor = self.anchor or {k: torch.zeros_like(self.state[k]) for k in self.parameters}
            copy_rows(self.anchor, anchors)
        for buffer in (*self.velocity.values(), self.loss_sum, self.correct):
            buffer.zero_()

    def batch(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The current step's (capacity, width) sample indices (int64) and real-sample mask (float32): one pair
        per batch width, so that training and evaluation batches each keep theirs."""
        if width not in self.batches:
            self.batches[width] = (
                torch.zeros(self.capacity, width, dtype=torch.long, device=self.device),
                torch.zeros(self.capacity, width, device=self.device),
            )
        return self.batches[width]

    def mutated(self, k: int) -> list[torch.Tensor]:
        """The rows that a training step of the first ``k`` members writes (views)."""
        return [v[:k] for v in (*self.state.values(), *self.velocity.values(), self.loss_sum)]

    def counted(self, k: int) -> list[torch.Tensor]:
        """The rows that an evaluation step of the first ``k`` members writes (views)."""
        return [self.correct[:k], self.loss_sum[:k]]


def zero_rows(template: Params, capacity: int, device: torch.device) -> Params:
    """name → zeros of shape ``(capacity, *template[name].shape)`` and its dtype: room for ``capacity`` clients."""
    return {k: torch.zeros((capacity, *v.shape), dtype=v.dtype, device=device) for k, v in template.items()}


def copy_rows(stacked: Params, states: list[Params]) -> None:
    """Rows 0..len(states)-1 of each of ``stacked``'s tensors ← the clients' tensors of that name."""
    for name, rows in stacked.items():
        rows[: len(states)].copy_(torch.stack([s[name] for s in states]))


def stack(states: list[Params], device: torch.device, keys: Optional[list[str]] = None) -> Params:
    """The clients' tensors of each key (default: all of the first state's) stacked on a new leading axis."""
    return {k: torch.stack([s[k] for s in states]).to(device) for k in keys or states[0]}


def unstack(state: Params, count: int) -> list[Params]:
    """The first ``count`` rows, each client's own copy on the CPU (a view would keep the whole stack alive in
    the store)."""
    cpu = {k: v[:count].cpu() for k, v in state.items()}
    return [{k: v[c].clone() for k, v in cpu.items()} for c in range(count)]


def first_rows(state: Optional[Params], k: int) -> Optional[Params]:
    """The first ``k`` clients' slices of a stacked state (views: updates reach the stack)."""
    return None if state is None else {name: v[:k] for name, v in state.items()}
