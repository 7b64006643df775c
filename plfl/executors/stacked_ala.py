"""ALA's weight learning for a cohort of clients at once, stacked on a client axis (the vectorized executor's).

The same algorithm as :class:`plfl.methods.ala.AdaptiveLocalAggregation` (FedALA, Eq. 3–5, Alg. 1 lines
6–16), client for client: each client learns W_i on its own s % sample, in its own mini-batches, and each step
updates every client that still has a batch (``vmap(grad(loss))`` over ``functional_call``). An epoch ends
with one synchronisation for the clients' last batch losses, which decide who goes on: after the initial
stage a client takes one epoch; in it, a client whose losses have settled (or that hit ``max_init_epochs``)
drops out while the others repeat their epochs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from plfl.executors.lockstep import MaskedBatchNorm, Split, masked, masked_batch_norms, stack, unstack
from plfl.executors.tasks import LocalAggregationTask
from plfl.methods.ala import ALAOutcome, head_only, sample_index, settled, top_names, warn_capped
from plfl.state import Params


def sample_rows(n: int, task: LocalAggregationTask, batch_size: int) -> torch.Tensor:
    """(B, batch_size) int64: the mini-batches of the task's s % sample of n training samples, the last one
    padded with -1 (the batches :class:`~plfl.methods.ala.AdaptiveLocalAggregation` takes every epoch)."""
    index = sample_index(n, task.config.s, torch.Generator().manual_seed(task.seed))
    return torch.cat([index, index.new_full(((-len(index)) % batch_size,), -1)]).view(-1, batch_size)


def aggregate_cohort(model: nn.Module, split: Split, tasks: list[LocalAggregationTask], rows: list[torch.Tensor],
                     device: torch.device) -> list[ALAOutcome]:
    """ALA of a cohort sharing one config, ``rows[c]`` the batches of ``tasks[c]`` (:func:`sample_rows`) in
    non-increasing length; data in ``split`` on ``device``. Warns as ALA does when an initial stage is capped."""
    config = tasks[0].config
    top = top_names(model, config.p)
    net, prefix = (model.head, "head.") if head_only(model, top) else (model, "")
    global_params = stack([t.global_params for t in tasks], device)
    local = stack([t.local_params for t in tasks], device, top)
    gap = {k: global_params[k] - local[k] for k in top}
    weights = stack([t.weights or {k: torch.ones_like(t.global_params[k]) for k in top} for t in tasks], device)
    fixed = {k.removeprefix(prefix): v for k, v in global_params.items() if k.startswith(prefix) and k not in top}
    index, mask, active = split.schedule([split.offsets[t.client_id] for t in tasks], rows)
    norms = masked_batch_norms(model)
    # One message to all (FedAvg's), and no BatchNorm batch statistics that must stay per client.
    shared = all(t.global_params is tasks[0].global_params for t in tasks) and not norms
    inputs = _inputs(model, norms, global_params, split, index, mask, active, shared) if prefix else None

    def loss(theta: Params, fixed: Params, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor):
        with masked(norms, m):  # BatchNorm: the batch statistics of the real samples; running ones discarded
            logits = functional_call(net, {**fixed, **{k.removeprefix(prefix): v for k, v in theta.items()}}, (x,),
                                     strict=True)
        value = (F.cross_entropy(logits, y, reduction="none") * m).sum() / m.sum()
        return value, value.detach()

    step = vmap(grad(loss, has_aux=True))
    losses: list[list[float]] = [[] for _ in tasks]
    running = list(range(len(tasks)))
    while running:
        run = torch.tensor(running, device=device)
        w, g, local_r, f = ({k: v[run] for k, v in state.items()} for state in (weights, gap, local, fixed))
        last = torch.zeros(len(running), device=device)
        for s in range(len(active)):
            k = sum(len(rows[c]) > s for c in running)
            if k == 0:
                break
            cols = run[:k]
            x = inputs[s][cols] if inputs is not None else split.x[index[s, cols]]
            theta = {n: local_r[n][:k] + g[n][:k] * w[n][:k] for n in top}
            grads, values = step(theta, {n: v[:k] for n, v in f.items()}, x, split.y[index[s, cols]], mask[s, cols])
            last[:k] = values
            for n in top:
                w[n][:k] = torch.clamp(w[n][:k] - config.eta * grads[n] * g[n][:k], 0, 1)
        for n in top:
            weights[n][run] = w[n]
        going = []
        for c, value in zip(running, last.cpu().tolist()):  # the epoch's one synchronisation
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


def _inputs(model: nn.Module, norms: list[tuple[str, MaskedBatchNorm]], global_params: Params, split: Split,
            index: torch.Tensor, mask: torch.Tensor, active: list[int], shared: bool) -> list[torch.Tensor]:
    """Per step s, the (active[s], W, *feature) features of the clients' batches under their fixed global
    bodies: when ALA aggregates head tensors only, the body is the same in every epoch, so it runs once.
    When every client received the same global model (``shared``), one body call takes all clients' rows."""
    body = {k.removeprefix("body."): v for k, v in global_params.items() if k.startswith("body.")}
    with torch.no_grad():
        if shared:
            one = {k: v[0] for k, v in body.items()}
            return [functional_call(model.body, one, (split.x[index[s, :a]].flatten(0, 1),), strict=True)
                    .unflatten(0, (a, -1)) for s, a in enumerate(active)]

        def forward(params: Params, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            with masked(norms, m):
                return functional_call(model.body, params, (x,), strict=True)

        return [vmap(forward)({k: v[:a] for k, v in body.items()}, split.x[index[s, :a]], mask[s, :a])
                for s, a in enumerate(active)]
