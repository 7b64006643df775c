"""ALA's weight learning for a cohort of clients at once, stacked on a client axis (the vectorized executor's).

The same algorithm as :class:`plfl.methods.ala.AdaptiveLocalAggregation` (FedALA, Eq. 3–5, Alg. 1 lines
6–16), client for client: each client learns W_i on its own s % sample, in its own mini-batches, and each step
updates every client that still has a batch (``vmap(grad(loss))`` over ``functional_call``). An epoch ends
with one synchronisation for the clients' last batch losses, which decide who goes on: after the initial
stage a client takes one epoch; in it, a client whose losses have settled (or that hit ``max_init_epochs``)
drops out while the others repeat their epochs. An epoch's running clients are copied to the first rows of
:class:`ALAState`, whose tensors outlive the cohort, so that a step is recorded once per number of active
clients and replayed (a CUDA graph on a CUDA device, :mod:`plfl.executors.step_graphs`).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from plfl.executors.lockstep import Split, masked, masked_batch_norms, stack, unstack, zero_rows
from plfl.executors.step_graphs import StepGraphs
from plfl.executors.tasks import LocalAggregationTask
from plfl.methods.ala import ALAOutcome, head_only, sample_index, settled, top_names, warn_capped
from plfl.state import Params


def sample_rows(n: int, task: LocalAggregationTask, batch_size: int) -> torch.Tensor:
    """(B, batch_size) int64: the mini-batches of the task's s % sample of n training samples, the last one
    padded with -1 (the batches :class:`~plfl.methods.ala.AdaptiveLocalAggregation` takes every epoch)."""
    index = sample_index(n, task.config.s, torch.Generator().manual_seed(task.seed))
    return torch.cat([index, index.new_full(((-len(index)) % batch_size,), -1)]).view(-1, batch_size)


class ALAState:
    """Up to ``capacity`` running clients' ALA tensors, row c client c's: ``weights`` W_i, ``gap`` Θ − Θ_i and
    ``local`` Θ_i of each top tensor, ``fixed`` the other tensors of the network ALA runs (the head, or the
    model), the current step's ``x`` (capacity, width, *sample.shape) inputs (the head's: body features),
    ``y`` (capacity, width) labels and ``mask`` (capacity, width) real samples, and ``last`` (capacity,) each
    client's latest batch loss. ``top``, ``fixed`` and ``sample``: one client's tensors and input."""

    def __init__(self, top: Params, fixed: Params, sample: torch.Tensor, capacity: int, width: int,
                 device: torch.device):
        self.layout, self.capacity = layout(top, fixed, sample), capacity
        self.weights, self.gap, self.local = (zero_rows(top, capacity, device) for _ in range(3))
        self.fixed = zero_rows(fixed, capacity, device)
        self.x = torch.zeros(capacity, width, *sample.shape, dtype=sample.dtype, device=device)
        self.y = torch.zeros(capacity, width, dtype=torch.long, device=device)
        self.mask = torch.zeros(capacity, width, device=device)
        self.last = torch.zeros(capacity, device=device)

    def load(self, run: torch.Tensor, weights: Params, gap: Params, local: Params, fixed: Params) -> None:
        """Rows 0..len(run)-1 ← the cohort's stacked tensors of its members ``run`` (an epoch's running
        clients); ``last`` ← 0."""
        for source, target in ((weights, self.weights), (gap, self.gap), (local, self.local), (fixed, self.fixed)):
            for name, value in source.items():
                target[name][:len(run)].copy_(value[run])
        self.last.zero_()

    def mutated(self, k: int) -> list[torch.Tensor]:
        """The rows that a step of the first ``k`` clients writes."""
        return [*(w[:k] for w in self.weights.values()), self.last[:k]]


def layout(top: Params, fixed: Params, sample: torch.Tensor) -> tuple:
    """What an :class:`ALAState` must match to serve a cohort besides its rows: names, shapes and dtypes."""
    return tuple((k, v.shape, v.dtype) for k, v in (*top.items(), *fixed.items(), ("x", sample)))


class StackedALA:
    """ALA for cohorts of clients on ``device``: ``model`` the architecture (its BatchNorm layers masked), its
    steps recorded and replayed by ``steps``."""

    def __init__(self, model: nn.Module, device: torch.device, steps: StepGraphs):
        self.model, self.device, self.steps = model, device, steps
        self.norms = masked_batch_norms(model)
        self.state: Optional[ALAState] = None

    def __call__(self, split: Split, tasks: list[LocalAggregationTask], rows: list[torch.Tensor]) -> list[ALAOutcome]:
        """ALA of a cohort sharing one config, ``rows[c]`` the batches of ``tasks[c]`` (:func:`sample_rows`) in
        non-increasing length; data in ``split`` on the device. Warns as ALA does when an initial stage is
        capped."""
        config, device = tasks[0].config, self.device
        model = self.model.train()
        top = top_names(model, config.p)
        net, prefix = (model.head, "head.") if head_only(model, top) else (model, "")
        global_params = stack([t.global_params for t in tasks], device)
        local = stack([t.local_params for t in tasks], device, top)
        gap = {k: global_params[k] - local[k] for k in top}
        weights = stack([t.weights or {k: torch.ones_like(t.global_params[k]) for k in top} for t in tasks], device)
        fixed = {k: v for k, v in global_params.items() if k.startswith(prefix) and k not in top}
        index, mask, active = split.schedule([split.offsets[t.client_id] for t in tasks], rows)
        # One message to all (FedAvg's), and no BatchNorm batch statistics that must stay per client.
        shared = all(t.global_params is tasks[0].global_params for t in tasks) and not self.norms
        inputs = self._features(global_params, split, index, mask, active, shared) if prefix else None
        state = self._state({k: v[0] for k, v in local.items()}, {k: v[0] for k, v in fixed.items()},
                            inputs[0][0, 0] if inputs else split.x[0], len(tasks), index.shape[-1])
        step = partial(self._step, state, net, prefix, config.eta)
        losses: list[list[float]] = [[] for _ in tasks]
        running = list(range(len(tasks)))
        while running:
            run = torch.tensor(running, device=device)
            state.load(run, weights, gap, local, fixed)
            for s in range(len(active)):
                k = sum(len(rows[c]) > s for c in running)
                if k == 0:
                    break
                cols = run[:k]
                state.x[:k].copy_(inputs[s][cols] if inputs is not None else split.x[index[s, cols]])
                state.y[:k].copy_(split.y[index[s, cols]])
                state.mask[:k].copy_(mask[s, cols])
                self.steps(("ala", prefix, tuple(top), config.eta, k), partial(step, k), partial(state.mutated, k))
            for name in top:
                weights[name][run] = state.weights[name][:len(running)]
            going = []
            for c, value in zip(running, state.last[:len(running)].cpu().tolist()):  # the epoch's one sync
                losses[c].append(value)
                if tasks[c].weights is None and not settled(config, losses[c]):
                    if len(losses[c]) < config.max_init_epochs:
                        going.append(c)
                    else:
                        warn_capped(config, tasks[c].client_id, losses[c])
            running = going
        params = {**global_params, **{k: local[k] + gap[k] * weights[k] for k in top}}
        return [ALAOutcome(p, w, len(c_losses))
                for p, w, c_losses in zip(unstack(params, len(tasks)), unstack(weights, len(tasks)), losses)]

    def _step(self, state: ALAState, net: nn.Module, prefix: str, eta: float, k: int) -> None:
        """W ← clamp(W − η ∇_Θ̂ L(Θ̂) ⊙ (Θ − Θ_i), 0, 1) (Eq. 5) for the first ``k`` rows of ``state``, reading and
        writing only its tensors (so that it can be replayed)."""
        theta = {n: state.local[n][:k] + state.gap[n][:k] * state.weights[n][:k] for n in state.weights}
        fixed = {n: v[:k] for n, v in state.fixed.items()}
        grads, values = vmap(grad(partial(self._loss, net, prefix), has_aux=True))(
            theta, fixed, state.x[:k], state.y[:k], state.mask[:k])
        state.last[:k] = values
        for n, g in grads.items():
            w = state.weights[n][:k]
            w.copy_(torch.clamp(w - eta * g * state.gap[n][:k], 0, 1))

    def _loss(self, net: nn.Module, prefix: str, theta: Params, fixed: Params, x: torch.Tensor, y: torch.Tensor,
              m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One client's batch-mean cross-entropy under Θ̂ (twice: the value to differentiate and its record)."""
        with masked(self.norms, m):  # BatchNorm: the batch statistics of the real samples; running ones discarded
            logits = functional_call(net, {k.removeprefix(prefix): v for k, v in {**fixed, **theta}.items()}, (x,),
                                     strict=True)
        value = (F.cross_entropy(logits, y, reduction="none") * m).sum() / m.sum()
        return value, value.detach()

    def _state(self, top: Params, fixed: Params, sample: torch.Tensor, capacity: int, width: int) -> ALAState:
        """The persistent state, replaced (and the recorded steps forgotten) when it cannot serve the cohort."""
        state = self.state
        if state is None or state.layout != layout(top, fixed, sample) or state.capacity < capacity:
            self.steps.clear()
            self.state = None  # the old tensors go before the new ones come
            self.state = ALAState(top, fixed, sample, capacity, width, self.device)
        return self.state

    def _features(self, global_params: Params, split: Split, index: torch.Tensor, mask: torch.Tensor,
                  active: list[int], shared: bool) -> list[torch.Tensor]:
        """Per step s, the (active[s], W, *feature) features of the clients' batches under their fixed global
        bodies: when ALA aggregates head tensors only, the body is the same in every epoch, so it runs once.
        When every client received the same global model (``shared``), one body call takes all clients' rows."""
        body = {k.removeprefix("body."): v for k, v in global_params.items() if k.startswith("body.")}
        with torch.no_grad():
            if shared:
                one = {k: v[0] for k, v in body.items()}
                return [functional_call(self.model.body, one, (split.x[index[s, :a]].flatten(0, 1),), strict=True)
                        .unflatten(0, (a, -1)) for s, a in enumerate(active)]

            def forward(params: Params, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
                with masked(self.norms, m):
                    return functional_call(self.model.body, params, (x,), strict=True)

            return [vmap(forward)({k: v[:a] for k, v in body.items()}, split.x[index[s, :a]], mask[s, :a])
                    for s, a in enumerate(active)]
