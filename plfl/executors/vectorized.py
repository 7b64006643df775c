"""The vectorized executor: a round's clients trained and evaluated together, stacked on a client axis.

Tasks of one ``train`` call with the same options (epochs or steps, trainable set, proximal μ) train in cohorts
of at most ``cohort_size`` clients: their states are stacked on a leading axis, and each step trains every client
on its own next mini-batch with ``vmap(grad(loss))`` over ``functional_call`` (torch.func), in exactly the batch
order ``LocalTrainer`` gives that client alone. The update is ``torch.optim.SGD``'s (v ← m·v + g, v = g at the
first step; θ ← θ − lr·v) on the trainable parameters; the loss is the batch-mean cross-entropy, padding masked
out, plus the proximal term; BatchNorm layers run as :class:`~plfl.executors.lockstep.MaskedBatchNorm` (batch
statistics of the real samples, each client's running statistics written back into its state). Evaluation stacks
the models the same way (running statistics), and ALA's weight learning runs in cohorts too
(:mod:`plfl.executors.stacked_ala`). Data and states stay on the device; a
cohort synchronises once, at its end. A training or evaluation step reads and writes only the stacked state that
all cohorts share (:class:`~plfl.executors.lockstep.CohortState`; ALA's steps likewise), so on a CUDA device each
step shape (active clients, batch width, options) is captured once as a CUDA graph and replayed from then on
(:mod:`plfl.executors.step_graphs`, ``federation.cuda_graphs``). What it cannot run exactly
(:func:`plfl.executors.lockstep.unsupported`, ``data.augment``) goes to the sequential executor with a one-time
``PlflWarning``.
"""
from __future__ import annotations

import copy
import math
import warnings
from collections import defaultdict
from functools import cached_property, partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from plfl.client import EVAL_BATCH_SIZE, EvalResult, LocalTrainer, TrainResult
from plfl.data import FederatedData
from plfl.errors import PlflError, PlflWarning
from plfl.executors.lockstep import (CohortState, Split, first_rows, masked, masked_batch_norms,
                                     ordered_rows, shuffled_rows, unstack, unsupported, with_masked_batch_norms)
from plfl.executors.sequential import SequentialExecutor
from plfl.executors.stacked_ala import StackedALA, sample_rows
from plfl.executors.step_graphs import StepGraphs
from plfl.executors.tasks import ClientFailure, EvalTask, LocalAggregationTask, TrainTask, checked, raised
from plfl.methods.ala import ALAOutcome
from plfl.state import Params


class VectorizedExecutor:
    """Trains and evaluates cohorts of clients in lock-step on ``device`` (see the module docstring)."""

    def __init__(self, data: FederatedData, trainer: LocalTrainer, device: torch.device,
                 cohort_size: Optional[int], precision: str, cuda_graphs: bool = True):
        self.data, self.device, self.cohort_size = data, device, cohort_size
        self.sequential = SequentialExecutor(data, trainer)
        module = trainer.module
        self.trainer = trainer
        self.batch_size, self.lr, self.momentum = trainer.batch_size, module.lr, module.momentum
        # The architecture (states come with the tasks), its BatchNorm layers masked for padded batches.
        self.model = with_masked_batch_norms(copy.deepcopy(module.model)).to(device)
        self.norms = masked_batch_norms(self.model)
        self.cohort: Optional[CohortState] = None  # grown to the largest cohort (_cohort_state)
        self.steps = StepGraphs(capture=cuda_graphs and device.type == "cuda")
        self.ala = StackedALA(self.model, device, self.steps)
        self.eval_reason = unsupported(module.model, precision)
        augment = "data.augment draws random crops and flips" if module.train_transform is not None else None
        self.train_reason = self.eval_reason or augment
        self.noticed: set[str] = set()

    def train(self, tasks: list[TrainTask]) -> list[TrainResult | ClientFailure]:
        if self.train_reason:
            return self._fall_back(self.train_reason, self.sequential.train, tasks)
        if any(task.samples is not None for task in tasks):
            return self._fall_back("a task trains on part of a client's training split (FedFomo's validation "
                                   "hold-out)", self.sequential.train, tasks)
        return self._in_cohorts(
            tasks, lambda t: (t.epochs, t.steps, t.trainable, None if t.proximal is None else t.proximal.mu),
            lambda t: shuffled_rows(self.data.clients[t.client_id].num_train, self.batch_size, t.seed, t.epochs,
                                    t.steps, self.trainer.epoch_size(self.data.clients[t.client_id].num_train)),
            self._train_cohort, "local training")

    def _train_cohort(self, tasks: list[TrainTask], rows: list[torch.Tensor]) -> list[TrainResult | ClientFailure]:
        first = tasks[0]
        cohort = self._cohort_state(len(tasks))
        cohort.load([t.params for t in tasks], None if first.proximal is None else [t.proximal.anchor for t in tasks])
        self.model.train()
        names = [n for n in cohort.parameters if first.trainable is None or n in first.trainable]
        mu = None if first.proximal is None else first.proximal.mu
        step = partial(self._train_step, cohort, names, mu)
        self._run_steps(cohort, self.train_split, [self.train_split.offsets[t.client_id] for t in tasks], rows,
                        ("train", first.trainable, mu), step, cohort.mutated)
        samples = [int((r >= 0).sum()) for r in rows]
        losses = cohort.loss_sum[:len(tasks)].cpu().tolist()  # the cohort's one synchronisation
        return [checked(TrainResult(p, losses[c] / samples[c] if samples[c] else math.nan, samples[c]))
                for c, p in enumerate(unstack(cohort.state, len(tasks)))]

    def _run_steps(self, cohort: CohortState, split: Split, offsets: list[int], rows: list[torch.Tensor],
                   key: tuple, step: Callable[[int], None], mutated: Callable[[int], list[torch.Tensor]]) -> None:
        """The lock-step schedule of ``rows`` (members' (S_c, W) sample rows of ``split``, from ``offsets``):
        each step's samples into ``cohort.batch(W)``, then ``step(k)`` for the k active members, recorded once
        per ``(*key, W, k)`` (:mod:`plfl.executors.step_graphs`)."""
        index, mask, active = split.schedule(offsets, rows)
        width = index.shape[-1]
        batch_index, batch_mask = cohort.batch(width)
        for s, k in enumerate(active):
            batch_index[:k].copy_(index[s, :k])
            batch_mask[:k].copy_(mask[s, :k])
            self.steps((*key, width, k), partial(step, k), partial(mutated, k))

    def _train_step(self, cohort: CohortState, names: list[str], mu: Optional[float], k: int) -> None:
        """One SGD step of the cohort's first ``k`` members on their batches in ``cohort.batch``, reading and
        writing only ``cohort``'s tensors (so that it can be replayed, :mod:`plfl.executors.step_graphs`)."""
        state = first_rows(cohort.state, k)
        params = {n: state[n] for n in names}
        fixed = {n: v for n, v in state.items() if n not in params}
        anchor = {n: cohort.anchor[n][:k] for n in names} if mu is not None else None
        index, mask = (t[:k] for t in cohort.batch(self.batch_size))
        step = vmap(grad(partial(self._loss, mu=mu), has_aux=True), in_dims=(0, 0, 0, 0, 0, None if mu is None else 0))
        grads, (losses, statistics) = step(params, fixed, self.train_split.x[index], self.train_split.y[index], mask,
                                           anchor)
        cohort.loss_sum[:k] += losses
        for name, value in statistics.items():  # BatchNorm's running statistics, per client
            state[name].copy_(value)
        for name, g in grads.items():
            if self.momentum:  # torch.optim.SGD's buffer: the first step's is the gradient (0·m + g)
                g = cohort.velocity[name][:k].mul_(self.momentum).add_(g)
            params[name].add_(g, alpha=-self.lr)

    def _loss(self, params: Params, fixed: Params, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
              anchor: Optional[Params], mu: Optional[float]) -> tuple[torch.Tensor, tuple[torch.Tensor, Params]]:
        """One client's batch-mean cross-entropy (+ μ/2 ‖θ − anchor‖²), and (its summed cross-entropy, its
        BatchNorm layers' new running statistics by state-dict name)."""
        with masked(self.norms, mask) as statistics:
            logits = functional_call(self.model, {**params, **fixed}, (x,), strict=True)
        summed = (F.cross_entropy(logits, y, reduction="none") * mask).sum()
        loss = summed / mask.sum()
        if anchor is not None:
            loss = loss + mu / 2 * torch.stack([(p - anchor[k]).pow(2).sum() for k, p in params.items()]).sum()
        return loss, (summed.detach(), statistics)

    def aggregate_locally(self, tasks: list[LocalAggregationTask]) -> list[ALAOutcome | ClientFailure]:
        """ALA's weight learning in cohorts of clients sharing a config (:mod:`plfl.executors.stacked_ala`)."""
        if self.eval_reason:
            return self._fall_back(self.eval_reason, self.sequential.aggregate_locally, tasks)
        return self._in_cohorts(
            tasks, lambda t: id(t.config),
            lambda t: sample_rows(self.data.clients[t.client_id].num_train, t, self.batch_size),
            lambda cohort, rows: [checked(o) for o in self.ala(self.train_split, cohort, rows)],
            "ALA")

    def _in_cohorts(self, tasks: list, key: Callable, rows_of: Callable, run: Callable, work: str) -> list:
        """Each task's outcome: tasks grouped by ``key(task)`` (what a cohort must share), each group cut into
        cohorts, longest ``rows_of(task)`` first, and each cohort run by ``run(tasks, rows)``; a cohort that
        raises fails its clients alone (``PlflError``, bad input, propagates)."""
        groups = defaultdict(list)
        for i, t in enumerate(tasks):
            groups[key(t)].append(i)
        outcomes: list = [None] * len(tasks)
        for group in groups.values():
            rows = {i: rows_of(tasks[i]) for i in group}
            for cohort in self._cohorts(sorted(group, key=lambda i: -len(rows[i]))):
                try:
                    results = run([tasks[i] for i in cohort], [rows[i] for i in cohort])
                except PlflError:
                    raise
                except Exception as error:  # noqa: BLE001  the cohort's clients fail, the federation goes on
                    results = [raised(error, work)] * len(cohort)
                for i, result in zip(cohort, results):
                    outcomes[i] = result
        return outcomes

    def evaluate(self, tasks: list[EvalTask]) -> list[EvalResult]:
        if self.eval_reason:
            return self._fall_back(self.eval_reason, self.sequential.evaluate, tasks)
        split = self.test_split
        spans = [(0, len(split.y)) if t.client_id is None else (split.offsets[t.client_id], split.sizes[t.client_id])
                 for t in tasks]
        clients = sorted((i for i, t in enumerate(tasks) if t.client_id is not None), key=lambda i: -spans[i][1])
        results: list = [None] * len(tasks)
        for members in [*self._cohorts(clients), *([i] for i, t in enumerate(tasks) if t.client_id is None)]:
            width = max(1, EVAL_BATCH_SIZE // len(members))
            cohort = self._cohort_state(len(members))
            cohort.load([tasks[i].params for i in members])
            self.model.eval()  # BatchNorm: running statistics
            self._run_steps(cohort, split, [spans[i][0] for i in members],
                            [ordered_rows(spans[i][1], width) for i in members], ("evaluate",),
                            partial(self._evaluation_step, cohort, width), cohort.counted)
            correct, losses = (t[:len(members)].cpu().tolist() for t in (cohort.correct, cohort.loss_sum))
            for i, c, loss in zip(members, correct, losses):
                n = spans[i][1]
                results[i] = EvalResult(int(c), n, loss / n if n else math.nan)
        return results

    def _evaluation_step(self, cohort: CohortState, width: int, k: int) -> None:
        """The correct predictions and summed cross-entropy of the cohort's first ``k`` members on their batches
        in ``cohort.batch(width)``, added to ``cohort.correct`` and ``cohort.loss_sum``."""
        index, mask = (t[:k] for t in cohort.batch(width))
        split = self.test_split
        with torch.no_grad():
            logits = vmap(partial(functional_call, self.model, strict=True))(first_rows(cohort.state, k),
                                                                             (split.x[index],))
            y = split.y[index]
            cohort.correct[:k] += ((logits.argmax(-1) == y) * mask).sum(1)
            cohort.loss_sum[:k] += (F.cross_entropy(logits.transpose(1, 2), y, reduction="none") * mask).sum(1)

    def close(self) -> None:
        """Nothing to release: the device's memory goes with the executor."""

    @cached_property
    def train_split(self) -> Split:
        return Split.of([(c.x_train, c.y_train) for c in self.data.clients], self.device)

    @cached_property
    def test_split(self) -> Split:
        return Split.of([(c.x_test, c.y_test) for c in self.data.clients], self.device)

    def _cohort_state(self, size: int) -> CohortState:
        """The stacked state that cohorts share, replaced by a larger one (and the recorded steps, which read
        the old one, forgotten) when ``size`` clients do not fit."""
        if self.cohort is None or self.cohort.capacity < size:
            self.steps.clear()
            self.cohort = None  # the old tensors go before the new ones come
            self.cohort = CohortState(self.model.state_dict(), [n for n, _ in self.model.named_parameters()], size,
                                      self.device, bool(self.momentum))
        return self.cohort

    def _cohorts(self, order: list[int]) -> list[list[int]]:
        size = self.cohort_size or max(len(order), 1)
        return [order[i:i + size] for i in range(0, len(order), size)]

    def _fall_back(self, reason: str, run, tasks: list):
        if tasks and reason not in self.noticed:
            self.noticed.add(reason)
            warnings.warn(PlflWarning(f"federation.executor=vectorized runs this work on the sequential executor: "
                                      f"{reason}."), stacklevel=3)
        return run(tasks)

