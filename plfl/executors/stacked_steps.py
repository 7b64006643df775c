"""A cohort's :class:`~plfl.tasks.StepTask` s at once, stacked on a client axis (the vectorized executor's).

The same computation as :func:`~plfl.executors.steps.run_step_task`, client for client: each client runs the
step on its own batches in its own order, and each lock-step step updates every client that still has a batch
(``vmap`` of the method's step over the clients' states). Local epochs run one after another, each ending with
one synchronisation (every client's last batch loss). An epoch's running clients sit in the first rows of
:class:`StepState`, whose tensors outlive the cohort, so that a step is recorded once per number of active
clients and replayed (a CUDA graph on a CUDA device, :mod:`plfl.executors.step_graphs`). There is one
StepState per layout of tasks (:func:`layout`), so a method that runs steps of several layouts each round
(FedPAC's head and body steps) records each step once, not once per round. Tensors that all of a cohort's tasks
share (the very same tensors under the same names) are kept once, not per client.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
from torch.func import vmap

from plfl.executors.lockstep import Split, first_rows, stack, unstack, zero_rows
from plfl.executors.step_graphs import StepGraphs
from plfl.executors.steps import FunctionalNetwork
from plfl.privacy import dp_sgd_noise, noise_generator
from plfl.state import Params
from plfl.tasks import Batch, Step, StepResult, StepTask, shared_identity


class StepState:
    """Up to ``capacity`` running clients' tensors, row c client c's: ``state``, ``inputs`` and (unless
    ``common``, one copy for all) ``shared`` like one task's; the current batch's ``x``
    ``(capacity, width, *sample.shape)``, ``y`` (capacity, width) and ``mask`` (capacity, width); ``last``
    (capacity,) each client's latest step loss, ``loss_sum`` (float64) its losses weighted by their samples,
    ``weight`` those samples; for a task with ``noise_std``, ``noise``: the current step's draws, rows like
    ``state``'s (else empty)."""

    def __init__(
        self, task: StepTask, common: bool, sample: torch.Tensor, capacity: int, width: int, device: torch.device
    ):
        self.layout, self.capacity = layout(task, common, sample, width), capacity
        self.state, self.inputs = zero_rows(task.state, capacity, device), zero_rows(task.inputs, capacity, device)
        self.shared = (
            {k: v.to(device) for k, v in task.shared.items()} if common else zero_rows(task.shared, capacity, device)
        )
        self.x = torch.zeros(capacity, width, *sample.shape, dtype=sample.dtype, device=device)
        self.y = torch.zeros(capacity, width, dtype=torch.long, device=device)
        self.mask = torch.zeros(capacity, width, device=device)
        self.noise = zero_rows(task.state, capacity, device) if task.noise_std else {}
        self.last, self.weight = torch.zeros(2, capacity, device=device)
        self.loss_sum = torch.zeros(capacity, dtype=torch.float64, device=device)

    def share(self, shared: Params) -> None:
        """The one copy of ``shared`` (``common``) ← this cohort's."""
        for name, value in shared.items():
            self.shared[name].copy_(value)

    def load(self, order: list[int], cohort: dict[str, Params], common: bool) -> None:
        """Rows 0..len(order)-1 ← the cohort's stacked ``state``, ``inputs``, ``shared`` and loss sums of its
        members ``order`` (an epoch's running clients)."""
        run = torch.tensor(order, device=self.last.device)
        for part in ("state", "inputs", "sums") if common else ("state", "inputs", "sums", "shared"):
            for name, rows in self.rows(part).items():
                rows[: len(order)].copy_(cohort[part][name][run])

    def save(self, order: list[int], cohort: dict[str, Params]) -> None:
        """The cohort's stacked ``state`` and loss sums of members ``order`` ← rows 0..len(order)-1."""
        if not order:
            return
        run = torch.tensor(order, device=self.last.device)
        for part in ("state", "sums"):
            for name, rows in self.rows(part).items():
                cohort[part][name][run] = rows[: len(order)]

    def rows(self, part: str) -> Params:
        """The tensors of ``part``: ``state``, ``inputs``, ``shared``, or ``sums`` (``loss_sum`` and ``weight``)."""
        return {"loss_sum": self.loss_sum, "weight": self.weight} if part == "sums" else getattr(self, part)

    def mutated(self, k: int) -> list[torch.Tensor]:
        """The rows that a step of the first ``k`` clients writes."""
        return [*(v[:k] for v in self.state.values()), self.last[:k], self.loss_sum[:k], self.weight[:k]]


def layout(task: StepTask, common: bool, sample: torch.Tensor, width: int) -> tuple:
    """What a :class:`StepState` must match to serve a cohort besides its rows: names, shapes and dtypes, and
    whether the steps take noise."""
    tensors = {
        **task.state,
        **{f"inputs/{k}": v for k, v in task.inputs.items()},
        **{f"shared/{k}": v for k, v in task.shared.items()},
        "x": sample,
    }
    return common, width, task.noise_std > 0, tuple((k, v.shape, v.dtype) for k, v in tensors.items())


class StackedSteps:
    """Step tasks for cohorts of clients on ``network``'s device, steps recorded and replayed by ``graphs``."""

    # Steps of more layouts than this (a method's step kinds, with and without a common shared part) drop the
    # states kept so far: each holds a copy of the model per client.
    max_layouts = 4

    def __init__(self, network: FunctionalNetwork, graphs: StepGraphs):
        self.network, self.graphs = network, graphs
        self.states: dict[tuple, StepState] = {}

    def __call__(
        self, split: Split, offsets: list[int], tasks: list[StepTask], rows: list[list[torch.Tensor]]
    ) -> list[StepResult]:
        """The tasks of one cohort (equal steps and options), ``rows[c]`` each epoch's batches of ``tasks[c]``
        (:func:`~plfl.executors.steps.epoch_rows`), its data in ``split`` on the device from row ``offsets[c]``."""
        first, device = tasks[0], self.network.device
        common = all(shared_identity(t) == shared_identity(first) for t in tasks)
        cohort = {
            "state": stack([t.state for t in tasks], device),
            "inputs": stack([t.inputs for t in tasks], device),
            "shared": {} if common else stack([t.shared for t in tasks], device),
            "sums": {
                "loss_sum": torch.zeros(len(tasks), dtype=torch.float64, device=device),
                "weight": torch.zeros(len(tasks), device=device),
            },
        }
        state = self._state(first, common, split.x[0], len(tasks), first.batch_size)
        generators = [noise_generator(t.seed, device) for t in tasks] if first.noise_std else []
        if common:
            state.share(first.shared)
        epoch_losses: list[list[float]] = [[] for _ in tasks]
        seen = [0] * len(tasks)
        running, order, epoch = [c for c in range(len(tasks)) if rows[c]], [], 0  # a client may have no batch
        while running:
            now = sorted(running, key=lambda c: -len(rows[c][epoch]))
            if now != order:
                state.save(order, cohort)
                state.load(now, cohort, common)
                order = now
            noise = (first.noise_std, [generators[c] for c in order]) if generators else None
            self._epoch(
                state, first.step, common, split, [offsets[c] for c in order], [rows[c][epoch] for c in order], noise
            )
            for c in order:
                seen[c] += int((rows[c][epoch] >= 0).sum())
            for c, value in zip(order, state.last[: len(order)].cpu().tolist()):  # the epoch's one synchronisation
                epoch_losses[c].append(value)
            epoch += 1
            running = [c for c in order if epoch < len(rows[c])]
        state.save(order, cohort)
        means = (cohort["sums"]["loss_sum"] / cohort["sums"]["weight"]).tolist()
        return [
            StepResult(s, mean, n, losses)
            for s, mean, n, losses in zip(unstack(cohort["state"], len(tasks)), means, seen, epoch_losses)
        ]

    def _epoch(
        self,
        state: StepState,
        step: Step,
        common: bool,
        split: Split,
        offsets: list[int],
        rows: list[torch.Tensor],
        noise: Optional[tuple[float, list[torch.Generator]]],
    ) -> None:
        """One local epoch of the running clients (in ``state``'s first rows, from ``offsets``), ``rows`` their
        batches; ``noise``: the tasks' ``noise_std`` and the running clients' generators, or None."""
        index, mask, _ = split.schedule(offsets, rows)
        for s in range(index.shape[0]):
            k = sum(len(r) > s for r in rows)
            state.x[:k].copy_(split.x[index[s, :k]])
            state.y[:k].copy_(split.y[index[s, :k]])
            state.mask[:k].copy_(mask[s, :k])
            if noise is not None:  # each client's draws in the state's order, as run_step_task takes them
                std, generators = noise
                for value in state.noise.values():
                    value[:k].copy_(torch.stack([dp_sgd_noise(value.shape[1:], std, g) for g in generators[:k]]))
            key = ("step", state.layout, step, k)
            self.graphs(key, partial(self._step, state, step, common, k), partial(state.mutated, k))

    def _step(self, state: StepState, step: Step, common: bool, k: int) -> None:
        """``step`` for the first ``k`` rows of ``state``, reading and writing only its tensors (so that it can be
        replayed)."""
        network = self.network

        def one(
            client: Params,
            inputs: Params,
            shared: Params,
            x: torch.Tensor,
            y: torch.Tensor,
            mask: torch.Tensor,
            noise: Params,
        ) -> tuple:
            return tuple(step(network, client, inputs, shared, Batch(x, y, mask, noise or None)))

        rows = first_rows(state.state, k)
        shared = state.shared if common else first_rows(state.shared, k)
        new, loss, samples = vmap(one, in_dims=(0, 0, None if common else 0, 0, 0, 0, 0))(
            rows,
            first_rows(state.inputs, k),
            shared,
            state.x[:k],
            state.y[:k],
            state.mask[:k],
            first_rows(state.noise, k),
        )
        for name, value in new.items():
            rows[name].copy_(value)
        state.last[:k] = loss
        state.loss_sum[:k] += loss.double() * samples
        state.weight[:k] += samples

    def _state(self, task: StepTask, common: bool, sample: torch.Tensor, capacity: int, width: int) -> StepState:
        """The persistent state of the task's layout; a new one when there is none of that layout yet, and when
        the one there has fewer rows than ``capacity`` or the layouts are too many, all states replaced and the
        recorded steps (which read them) forgotten."""
        key = layout(task, common, sample, width)
        state = self.states.get(key)
        if state is not None and state.capacity >= capacity:
            return state
        if state is not None or len(self.states) == self.max_layouts:
            self.graphs.clear()
            self.states.clear()  # the old tensors go before the new ones come
        state = self.states[key] = StepState(task, common, sample, capacity, width, self.network.device)
        return state
