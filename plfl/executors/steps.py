"""A :class:`~plfl.tasks.StepTask`'s batches, and the plain loop that runs one for one client (the sequential
executor's, and so the Ray actors')."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from torch.func import functional_call

from plfl.activity import current as activity
from plfl.batches import epoch_size, last_batch_minimum, sample_rows, training_rows
from plfl.state import Params
from plfl.tasks import Batch, StepResult, StepTask


def epoch_rows(task: StepTask, n: int, batch_norm: bool) -> list[torch.Tensor]:
    """Each epoch's (S, batch_size) int64 sample indices (padded with -1) that ``task`` runs on a client with n
    training samples, in order; with a stop rule, the cap's epochs. ``batch_norm``: the model has BatchNorm
    layers (a last batch must hold two samples per sub-batch, :func:`plfl.batches.last_batch_minimum`)."""
    minimum = last_batch_minimum(task.batch_size, batch_norm, task.sub_batches)
    if task.sample is not None:
        return [sample_rows(task.sample, task.batch_size, minimum)] * task.epochs
    rows = training_rows(n, task.batch_size, task.seed, task.epochs, task.steps, minimum)
    per_epoch = -(-epoch_size(n, task.batch_size, minimum) // task.batch_size)
    return list(rows.split(per_epoch)) if per_epoch else []


class PlainNetwork:
    """``model`` (the architecture; its own tensors are never used) as a :class:`~plfl.tasks.Network` for one
    client at a time: its BatchNorm layers update copies of the given running statistics in place."""

    def __init__(self, model: nn.Module):
        self.model = model.train()

    def __call__(
        self, state: Params, x: torch.Tensor, mask: Optional[torch.Tensor] = None, module: str = ""
    ) -> tuple[torch.Tensor, Params]:
        net = self.model.get_submodule(module)
        prefix = f"{module}." if module else ""
        tensors = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        buffers = {name: tensors[name].clone() for name, _ in net.named_buffers()}
        out = functional_call(net, {**tensors, **buffers}, (x,), strict=True)
        return out, {prefix + name: value for name, value in buffers.items()}


def run_step_task(
    task: StepTask, network: PlainNetwork, x: torch.Tensor, y: torch.Tensor, batch_norm: bool
) -> StepResult:
    """``task`` on the client's training split x ``(n, *input_shape)``, y (n,), on their device: ``task.step``
    on each batch in turn; a fixed sample's batches are prepared once."""
    device = x.device
    state, inputs, shared = ({k: v.to(device) for k, v in d.items()} for d in (task.state, task.inputs, task.shared))
    prepared: dict[int, torch.Tensor] = {}
    loss_sum, weight, seen, epoch_losses = 0.0, 0.0, 0, []
    for rows in epoch_rows(task, len(y), batch_norm):
        last = math.nan
        for b, row in enumerate(rows):
            index = row[row >= 0].to(device)
            if b not in prepared:
                inputs_b = task.step.prepare(network, shared, x[index], None)
                if task.sample is not None:  # the same batches every epoch
                    prepared[b] = inputs_b
            else:
                inputs_b = prepared[b]
            out = task.step(network, state, inputs, shared, Batch(inputs_b, y[index], None))
            state, last, samples = out.state, float(out.loss), float(out.samples)
            activity.add_steps()
            loss_sum, weight, seen = loss_sum + last * samples, weight + samples, seen + len(index)
        epoch_losses.append(last)
        if task.stop is not None and task.stop(epoch_losses):
            break
    cpu = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
    return StepResult(cpu, loss_sum / weight if weight else math.nan, seen, epoch_losses)
