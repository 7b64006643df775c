"""A :class:`~plfl.tasks.StepTask`'s batches, the clients' architecture as a function of their states (every
executor's :class:`~plfl.tasks.Network`), the plain loop that runs a step task for one client (the sequential
executor's, and so the Ray actors'), a :class:`~plfl.tasks.FeatureTask` for one client (every executor's), and an
:class:`~plfl.tasks.EvalTask` with a method's :class:`~plfl.tasks.Forward` for one client (the sequential
executor's)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from plfl.activity import current as activity
from plfl.batches import EVAL_BATCH_SIZE, epoch_size, sample_rows, smallest_batch, training_rows
from plfl.executors.lockstep import masked, masked_batch_norms
from plfl.privacy import dp_sgd_noise, noise_generator
from plfl.state import Params
from plfl.tasks import Batch, EvalResult, EvalTask, FeatureResult, FeatureTask, StepResult, StepTask


def epoch_rows(task: StepTask, n: int, batch_norm: bool) -> list[torch.Tensor]:
    """Each epoch's (S, batch_size) int64 sample indices (padded with -1) that ``task`` runs on a client with n
    training samples (``task.data``'s, if given), in order. ``batch_norm``: the model has BatchNorm layers (a
    last batch must hold two samples, :func:`plfl.batches.smallest_batch`, and at least ``task.min_last_batch``)."""
    n = n if task.data is None else len(task.data[1])
    minimum = max(task.min_last_batch, smallest_batch(batch_norm))
    if task.ordered_samples is not None:
        return [sample_rows(task.ordered_samples, task.batch_size, minimum)] * task.epochs
    rows = training_rows(n, task.batch_size, task.seed, task.epochs, task.steps, minimum)
    per_epoch = -(-epoch_size(n, task.batch_size, minimum) // task.batch_size)
    return list(rows.split(per_epoch)) if per_epoch else []


class FunctionalNetwork:
    """``model`` (the architecture; its own tensors are never used) as a :class:`~plfl.tasks.Network`: each call
    runs a submodule on the tensors it is given. Its BatchNorm layers are torch's, which update copies of the
    given running statistics in place (one client at a time, the sequential executor's), or
    :class:`~plfl.executors.lockstep.MaskedBatchNorm` layers, which count the real samples of a padded batch and
    return the statistics as new tensors, so that ``vmap`` can run the network (the vectorized executor's)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model.train(), device
        self.parts: dict[str, tuple] = {}  # module name → (submodule, its masked BatchNorm layers, its buffer names)

    def __call__(
        self, state: Params, x: torch.Tensor, mask: Optional[torch.Tensor] = None, module: str = ""
    ) -> tuple[torch.Tensor, Params]:
        if module not in self.parts:
            net = self.model.get_submodule(module)
            self.parts[module] = net, masked_batch_norms(net), [name for name, _ in net.named_buffers()]
        net, norms, buffers = self.parts[module]
        prefix = f"{module}." if module else ""
        tensors = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        if norms:
            with masked(norms, mask) as statistics:
                out = functional_call(net, tensors, (x,), strict=True)
            return out, {prefix + name: statistics.get(name, tensors[name]) for name in buffers}
        updated = {name: tensors[name].clone() for name in buffers}
        out = functional_call(net, {**tensors, **updated}, (x,), strict=True)
        return out, {prefix + name: value for name, value in updated.items()}


def run_step_task(
    task: StepTask, network: FunctionalNetwork, x: torch.Tensor, y: torch.Tensor, batch_norm: bool
) -> StepResult:
    """``task`` on the client's training split x ``(n, *input_shape)``, y (n,), on their device: ``task.step``
    on each batch in turn."""
    device = x.device
    state, inputs, shared = ({k: v.to(device) for k, v in d.items()} for d in (task.state, task.inputs, task.shared))
    generator = noise_generator(task.seed, device) if task.noise_std else None
    loss_sum, weight, seen, epoch_losses = 0.0, 0.0, 0, []
    for rows in epoch_rows(task, len(y), batch_norm):
        last = math.nan
        for row in rows:
            index = row[row >= 0].to(device)
            noise = None
            if generator is not None:
                noise = {k: dp_sgd_noise(state[k].shape, task.noise_std, generator) for k in task.state}
            out = task.step(network, state, inputs, shared, Batch(x[index], y[index], None, noise))
            state, last, samples = out.state, float(out.loss), float(out.samples)
            activity.add_steps()
            loss_sum, weight, seen = loss_sum + last * samples, weight + samples, seen + len(index)
        epoch_losses.append(last)
    cpu = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
    return StepResult(cpu, loss_sum / weight if weight else math.nan, seen, epoch_losses)


def run_feature_task(
    task: FeatureTask, network: FunctionalNetwork, x: torch.Tensor, y: torch.Tensor, batch_norm: bool
) -> FeatureResult:
    """``task`` on the client's training split x ``(n, *input_shape)``, y (n,), on their device: ``task.module``
    on each batch of its samples in turn."""
    rows = sample_rows(task.samples, task.batch_size, smallest_batch(batch_norm))
    params = {k: v.to(x.device) for k, v in task.params.items()}
    with torch.no_grad():
        outputs = [network(params, x[row[row >= 0].to(x.device)], None, task.module)[0].cpu() for row in rows]
    kept = rows[rows >= 0]
    return FeatureResult(torch.cat(outputs) if outputs else x[:0].cpu(), y[kept.to(y.device)].cpu())


def run_forward_evaluation(
    task: EvalTask, network: FunctionalNetwork, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor
) -> EvalResult:
    """``task`` (one with a :class:`~plfl.tasks.Forward`) on the samples x ``(n, *input_shape)``, y (n,), whose
    indices in the evaluated split are ``rows`` (n,) int64, all on one device: the forward's logits in batches of
    ``EVAL_BATCH_SIZE``, without gradients, ``network`` in evaluation mode for the pass."""
    params = {k: v.to(x.device) for k, v in task.params.items()}
    correct, loss_sum = 0, 0.0
    network.model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(y), EVAL_BATCH_SIZE):
                batch = slice(start, start + EVAL_BATCH_SIZE)
                logits = task.forward(network, params, x[batch], rows[batch])
                correct += int((logits.argmax(-1) == y[batch]).sum())
                loss_sum += float(F.cross_entropy(logits, y[batch], reduction="sum"))
    finally:
        network.model.train()
    return EvalResult(correct, len(y), loss_sum / len(y) if len(y) else math.nan)
