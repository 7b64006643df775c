"""The vectorized executor: a round's clients trained and evaluated together, stacked on a client axis.

Tasks of one ``train`` call with the same options (epochs or steps, trainable set, proximal μ) train in cohorts
of at most ``cohort_size`` clients: their states are stacked on a leading axis, and each step trains every client
on its own next mini-batch with ``vmap(grad(loss))`` over ``functional_call`` (torch.func), in exactly the batch
order ``LocalTrainer`` gives that client alone (:mod:`plfl.batches`). The update is torch's SGD
(``torch.optim.sgd.sgd``, which ``torch.optim.SGD`` runs in Lightning's loop: v ← m·v + g, v = g at the first
step; θ ← θ − lr·v) on the trainable parameters; the loss is the batch-mean cross-entropy, padding masked out,
plus the proximal term (:func:`plfl.tasks.proximal_penalty`); BatchNorm layers run as
:class:`~plfl.executors.lockstep.MaskedBatchNorm` (batch statistics of the real samples, each client's running
statistics written back into its state). A method's own steps run in cohorts of equal steps, ``vmap`` of the
step (:mod:`plfl.executors.stacked_steps`); evaluation stacks the models the same way (running statistics), and
a method's own prediction (:class:`~plfl.tasks.Forward`) runs as ``vmap`` of it over the stacked models.
Data and states stay on the device; a cohort synchronises once, at its end (a step task once per epoch). A
training or evaluation step reads and writes only the stacked state that all cohorts share
(:class:`~plfl.executors.lockstep.CohortState`; the step tasks' likewise), so on a CUDA device each step shape
(active clients, batch width, options) is captured once as a CUDA graph and replayed from then on
(:mod:`plfl.executors.step_graphs`, ``vectorized.cuda_graphs``). What it cannot run exactly
(:func:`plfl.executors.lockstep.unsupported`, ``data.augment``) goes to the fallback (sequential) executor with a
one-time ``PlflWarning``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections import defaultdict
from functools import cached_property, partial
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.optim.sgd import sgd

from plfl.activity import current as activity
from plfl.batches import EVAL_BATCH_SIZE, has_batch_norm, last_batch_minimum, padded_rows, training_rows
from plfl.data.federated import FederatedData
from plfl.errors import PlflError, PlflWarning
from plfl.executors.base import Executor
from plfl.executors.lockstep import (
    CohortState,
    Split,
    first_rows,
    masked,
    masked_batch_norms,
    stack,
    unstack,
    unsupported,
    with_masked_batch_norms,
)
from plfl.executors.stacked_steps import StackedSteps
from plfl.executors.step_graphs import StepGraphs
from plfl.executors.steps import FunctionalNetwork, epoch_rows, run_feature_task
from plfl.privacy import dp_sgd_noise, noise_generator, private_gradient
from plfl.state import Params
from plfl.tasks import (
    ClientFailure,
    EvalResult,
    EvalTask,
    FeatureResult,
    FeatureTask,
    Forward,
    StepResult,
    StepTask,
    TrainResult,
    TrainTask,
    finite_or_failure,
    proximal_penalty,
    raised,
)

if TYPE_CHECKING:
    from plfl.executors.options import ClientWorkOptions, Vectorized


class VectorizedExecutor:
    """Trains and evaluates cohorts of clients in lock-step on ``device`` (see the module docstring):
    ``architecture`` the clients' model, ``work`` the local training's options, ``options`` the ``vectorized.*``
    keys; what it cannot run goes to ``fallback``."""

    def __init__(
        self,
        data: FederatedData,
        architecture: nn.Module,
        work: ClientWorkOptions,
        options: Vectorized,
        device: torch.device,
        fallback: Executor,
    ):
        federation, precision, augment = work.federation, work.trainer.precision, work.augment
        self.data, self.device, self.cohort_size = data, device, options.cohort_size
        self.fallback = fallback
        self.batch_size, self.lr, self.momentum = federation.batch_size, federation.lr, federation.momentum
        self.batch_norm = has_batch_norm(architecture)
        self.min_last = last_batch_minimum(self.batch_size, self.batch_norm, drop_last=federation.drop_last)
        # The architecture (states come with the tasks), its BatchNorm layers masked for padded batches.
        self.model = with_masked_batch_norms(copy.deepcopy(architecture)).to(device)
        self.norms = masked_batch_norms(self.model)
        self.cohort: Optional[CohortState] = None  # grown to the largest cohort (_cohort_state)
        self.dp_sgd = work.dp_sgd
        self.noise_generators: list[torch.Generator] = []  # DP-SGD's, of the cohort in training
        # DP-SGD's noise is drawn from each client's generator at every step, which a recorded graph would not redo.
        self.graphs = StepGraphs(capture=options.cuda_graphs and device.type == "cuda" and self.dp_sgd is None)
        self.stacked_steps = StackedSteps(FunctionalNetwork(self.model, device), self.graphs)
        self.eval_reason = unsupported(architecture, precision)
        augmented = "data.augment draws random crops and flips" if augment else None
        self.train_reason = self.eval_reason or augmented
        self.noticed: set[str] = set()
        # The samples of the last step call that carried its own (StepTask.data), and their split on the device.
        self.given: Optional[tuple[list, Split]] = None

    def train(self, tasks: list[TrainTask]) -> list[TrainResult | ClientFailure]:
        if self.train_reason:
            return self._fall_back(self.train_reason, self.fallback.train, tasks)
        return self._in_cohorts(
            tasks,
            # Lengths may differ within a cohort (the lock-step schedule drops finished members): Self-FL's l_m.
            lambda t: (t.trainable, None if t.proximal is None else t.proximal.mu),
            self._training_rows,
            self._train_cohort,
            "local training",
        )

    def _training_rows(self, task: TrainTask) -> torch.Tensor:
        """(S, batch_size) indices into the client's training split: LocalTrainer's batches of the task."""
        n = self.data.clients[task.client_id].num_train if task.samples is None else len(task.samples)
        rows = training_rows(n, self.batch_size, task.seed, task.epochs, task.steps, self.min_last)
        if task.samples is None:
            return rows
        return torch.where(rows >= 0, task.samples[rows.clamp(min=0)], -1)

    def _train_cohort(self, tasks: list[TrainTask], rows: list[torch.Tensor]) -> list[TrainResult | ClientFailure]:
        first = tasks[0]
        cohort = self._cohort_state(len(tasks))
        cohort.load([t.params for t in tasks], None if first.proximal is None else [t.proximal.anchor for t in tasks])
        self.model.train()
        names = [n for n in cohort.parameters if first.trainable is None or n in first.trainable]
        mu = None if first.proximal is None else first.proximal.mu
        if self.dp_sgd is None:
            step = partial(self._train_step, cohort, names, mu)
        else:
            # Read at every step, not bound to it: a step is kept per key and serves later cohorts too.
            self.noise_generators = [noise_generator(t.seed, self.device) for t in tasks]
            step = partial(self._private_step, cohort, names, mu)
        self._run_steps(
            cohort,
            self.train_split,
            [self.train_split.offsets[t.client_id] for t in tasks],
            rows,
            ("train", first.trainable, mu),
            step,
            cohort.mutated,
        )
        samples = [int((r >= 0).sum()) for r in rows]
        losses = cohort.loss_sum[: len(tasks)].cpu().tolist()  # the cohort's one synchronisation
        return [
            finite_or_failure(TrainResult(p, losses[c] / samples[c] if samples[c] else math.nan, samples[c]))
            for c, p in enumerate(unstack(cohort.state, len(tasks)))
        ]

    def _run_steps(
        self,
        cohort: CohortState,
        split: Split,
        offsets: list[int],
        rows: list[torch.Tensor],
        key: tuple,
        step: Callable[[int], None],
        mutated: Callable[[int], list[torch.Tensor]],
    ) -> None:
        """The lock-step schedule of ``rows`` (members' (S_c, W) sample rows of ``split``, from ``offsets``):
        each step's samples into ``cohort.batch(W)``, then ``step(k)`` for the k active members, recorded once
        per ``(*key, W, k)`` (:mod:`plfl.executors.step_graphs`)."""
        index, mask, active = split.schedule(offsets, rows)
        width = index.shape[-1]
        batch_index, batch_mask = cohort.batch(width)
        for s, k in enumerate(active):
            batch_index[:k].copy_(index[s, :k])
            batch_mask[:k].copy_(mask[s, :k])
            self.graphs((*key, width, k), partial(step, k), partial(mutated, k))
            activity.add_steps(k)

    def _train_step(self, cohort: CohortState, names: list[str], mu: Optional[float], k: int) -> None:
        """One SGD step of the cohort's first ``k`` members on their batches in ``cohort.batch``, reading and
        writing only ``cohort``'s tensors (so that it can be replayed, :mod:`plfl.executors.step_graphs`)."""
        state = first_rows(cohort.state, k)
        params = {n: state[n] for n in names}
        fixed = {n: v for n, v in state.items() if n not in params}
        anchor = {n: cohort.anchor[n][:k] for n in names} if mu is not None else None
        index, mask = (t[:k] for t in cohort.batch(self.batch_size))
        step = vmap(grad(partial(self._loss, mu=mu), has_aux=True), in_dims=(0, 0, 0, 0, 0, None if mu is None else 0))
        grads, (losses, statistics) = step(
            params, fixed, self.train_split.x[index], self.train_split.y[index], mask, anchor
        )
        cohort.loss_sum[:k] += losses
        for name, value in statistics.items():  # BatchNorm's running statistics, per client
            state[name].copy_(value)
        self._sgd(cohort, params, grads, k)

    def _private_step(self, cohort: CohortState, names: list[str], mu: Optional[float], k: int) -> None:
        """One DP-SGD step (:func:`plfl.privacy.private_gradient`) of the cohort's first ``k`` members: per-sample
        gradients by ``vmap(grad)`` over each member's samples, clipped, summed and noised from each member's
        generator (``noise_generators``) as Opacus' ``DPOptimizer`` does (one draw per parameter, in the parameters'
        order), divided by the batch size, plus the proximal term's gradient; then :meth:`_sgd`."""
        state = first_rows(cohort.state, k)
        params = {n: state[n] for n in names}
        fixed = {n: v for n, v in state.items() if n not in params}
        index, mask = (t[:k] for t in cohort.batch(self.batch_size))
        per_sample = vmap(vmap(grad(self._sample_loss, has_aux=True), in_dims=(None, None, 0, 0)))
        grads, losses = per_sample(params, fixed, self.train_split.x[index], self.train_split.y[index])
        cohort.loss_sum[:k] += (losses * mask).sum(1)
        std = self.dp_sgd.noise_multiplier * self.dp_sgd.max_grad_norm
        noise = [
            torch.stack([dp_sgd_noise(params[n].shape[1:], std, g) for g in self.noise_generators[:k]]) for n in names
        ]
        private = vmap(partial(private_gradient, max_grad_norm=self.dp_sgd.max_grad_norm, batch_size=self.batch_size))
        gradients = dict(zip(names, private([grads[n] for n in names], mask, noise)))
        if mu is not None:
            anchor = {n: cohort.anchor[n][:k] for n in names}
            proximal = vmap(grad(proximal_penalty), in_dims=(0, 0, None))(params, anchor, mu)
            gradients = {n: g + proximal[n] for n, g in gradients.items()}
        self._sgd(cohort, params, gradients, k)

    def _sgd(self, cohort: CohortState, params: Params, grads: Params, k: int) -> None:
        """torch's SGD update of ``params`` (the first ``k`` members' rows) by ``grads``, with the cohort's
        velocity."""
        # The velocity starts at 0, so the first step's is the gradient, as torch.optim.SGD's new buffer.
        velocity = [cohort.velocity[name][:k] if self.momentum else None for name in grads]
        sgd(
            [params[name] for name in grads],
            list(grads.values()),
            velocity,
            foreach=False,
            weight_decay=0.0,
            momentum=self.momentum,
            lr=self.lr,
            dampening=0.0,
            nesterov=False,
            maximize=False,
        )

    def _sample_loss(
        self, params: Params, fixed: Params, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sample's cross-entropy (x ``(*input_shape)``, y a 0-dim label), twice: to differentiate and to sum."""
        logits = functional_call(self.model, {**params, **fixed}, (x[None],), strict=True)
        loss = F.cross_entropy(logits, y[None])
        return loss, loss.detach()

    def _loss(
        self,
        params: Params,
        fixed: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor,
        anchor: Optional[Params],
        mu: Optional[float],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, Params]]:
        """One client's batch-mean cross-entropy (+ μ/2 ‖θ − anchor‖²), and (its summed cross-entropy, its
        BatchNorm layers' new running statistics by state-dict name)."""
        with masked(self.norms, mask) as statistics:
            logits = functional_call(self.model, {**params, **fixed}, (x,), strict=True)
        summed = (F.cross_entropy(logits, y, reduction="none") * mask).sum()
        loss = summed / mask.sum()
        if anchor is not None:
            loss = loss + proximal_penalty(params, anchor, mu)
        return loss, (summed.detach(), statistics)

    def step(self, tasks: list[StepTask]) -> list[StepResult | ClientFailure]:
        """A method's steps in cohorts of tasks with equal steps and options
        (:mod:`plfl.executors.stacked_steps`)."""
        if self.eval_reason:
            return self._fall_back(self.eval_reason, self.fallback.step, tasks)
        self.model.train()
        return self._in_cohorts(
            tasks,
            lambda t: (
                t.step,
                t.batch_size,
                t.epochs,
                t.steps,
                t.ordered_samples is None,
                t.min_last_batch,
                t.data is None,
                t.noise_std,
            ),
            lambda t: epoch_rows(t, self.data.clients[t.client_id].num_train, self.batch_norm),
            lambda cohort, rows: [
                finite_or_failure(r, r.state) for r in self.stacked_steps(*self._step_data(cohort), cohort, rows)
            ],
            tasks[0].step.work if tasks else "",
        )

    def _step_data(self, tasks: list[StepTask]) -> tuple[Split, list[int]]:
        """The split that the tasks' batches index, and where each task's samples start in it: the clients'
        training split, or the samples that the tasks carry (``StepTask.data``, all of them or none)."""
        if tasks[0].data is None:
            return self.train_split, [self.train_split.offsets[t.client_id] for t in tasks]
        data = [t.data for t in tasks]
        if self.given is None or not _same_tensors(self.given[0], data):  # ALA's epochs send the same ones again
            self.given = data, Split.of(data, self.device)
        return self.given[1], self.given[1].offsets

    def features(self, tasks: list[FeatureTask]) -> list[FeatureResult | ClientFailure]:
        """Each task on the device in turn, in batches of ``EVAL_BATCH_SIZE`` samples when the model has no
        BatchNorm layers (a sample's features do not depend on its batch then)."""
        if self.eval_reason:
            return self._fall_back(self.eval_reason, self.fallback.features, tasks)
        self.model.train()
        activity.start_work("features", len(tasks))
        split, results = self.train_split, []
        for task in tasks:
            start, size = split.offsets[task.client_id], split.sizes[task.client_id]
            x, y = split.x[start : start + size], split.y[start : start + size]
            batched = task if self.batch_norm else dataclasses.replace(task, batch_size=EVAL_BATCH_SIZE)
            try:
                results.append(run_feature_task(batched, self.stacked_steps.network, x, y, self.batch_norm))
            except PlflError:
                raise
            except Exception as error:  # noqa: BLE001  one client's failure must not end the federation
                results.append(raised(error, "feature extraction"))
            activity.finish_clients()
        return results

    def _in_cohorts(self, tasks: list, key: Callable, rows_of: Callable, run: Callable, work: str) -> list:
        """Each task's outcome: tasks grouped by ``key(task)`` (what a cohort must share), each group cut into
        cohorts, longest ``rows_of(task)`` first (a list of epochs: its first), and each cohort run by
        ``run(tasks, rows)``; a cohort that
        raises fails its clients alone (``PlflError``, bad input, propagates)."""
        activity.start_work(work if work != "local training" else "training", len(tasks))
        groups = defaultdict(list)
        for i, t in enumerate(tasks):
            groups[key(t)].append(i)
        outcomes: list = [None] * len(tasks)
        for group in groups.values():
            rows = {i: rows_of(tasks[i]) for i in group}
            for cohort in self._cohorts(sorted(group, key=lambda i: -_length(rows[i]))):
                try:
                    results = run([tasks[i] for i in cohort], [rows[i] for i in cohort])
                except PlflError:
                    raise
                except Exception as error:  # noqa: BLE001  the cohort's clients fail, the federation goes on
                    results = [raised(error, work)] * len(cohort)
                for i, result in zip(cohort, results):
                    outcomes[i] = result
                activity.finish_clients(len(cohort))
        return outcomes

    def evaluate(self, tasks: list[EvalTask]) -> list[EvalResult]:
        if self.eval_reason:
            return self._fall_back(self.eval_reason, self.fallback.evaluate, tasks)
        self.model.eval()  # BatchNorm: running statistics
        results: list = [None] * len(tasks)
        for (name, forward), members in self._evaluation_groups(tasks).items():
            split = {"test": self.test_split, "val": self.val_split, "train": self.train_split}[name]
            spans = {i: self._evaluation_span(split, tasks[i]) for i in members}
            clients = sorted(members, key=lambda i: -len(spans[i][1]))
            run = self._evaluate_cohort if forward is None else self._evaluate_forwards
            for cohort_members in self._cohorts(clients):
                run(
                    name,
                    split,
                    [tasks[i] for i in cohort_members],
                    [spans[i] for i in cohort_members],
                    results,
                    cohort_members,
                )
        return results

    @staticmethod
    def _evaluation_groups(tasks: list[EvalTask]) -> dict[tuple[str, Optional[Forward]], list[int]]:
        """The tasks' indices by the split they read, "test", "val" (the validation split) or "train" (the
        training split's ``samples``), and their :class:`~plfl.tasks.Forward` (None: the architecture's), those
        with tasks only."""
        groups: dict[tuple[str, Optional[Forward]], list[int]] = {}
        for i, task in enumerate(tasks):
            groups.setdefault(("train" if task.samples is not None else task.split, task.forward), []).append(i)
        order = ("test", "val", "train")
        return dict(sorted(groups.items(), key=lambda item: order.index(item[0][0])))

    @staticmethod
    def _evaluation_span(split: Split, task: EvalTask) -> tuple[int, torch.Tensor]:
        """(offset, (n,) indices from it) of the samples ``task`` evaluates in ``split``."""
        indices = torch.arange(split.sizes[task.client_id]) if task.samples is None else task.samples
        return split.offsets[task.client_id], indices

    def _evaluate_cohort(
        self,
        name: str,
        split: Split,
        tasks: list[EvalTask],
        spans: list[tuple[int, torch.Tensor]],
        results: list,
        positions: list[int],
    ) -> None:
        """The tasks' results on ``split`` (the one ``name``d by :meth:`_evaluation_groups`), into ``results`` at
        ``positions``."""
        width = max(1, EVAL_BATCH_SIZE // len(tasks))
        cohort = self._cohort_state(len(tasks))
        cohort.load([t.params for t in tasks])
        self._run_steps(
            cohort,
            split,
            [offset for offset, _ in spans],
            [padded_rows(indices, width) for _, indices in spans],
            ("evaluate", name),  # a recorded step reads its split's tensors: one recording per split
            partial(self._evaluation_step, cohort, split, width),
            cohort.counted,
        )
        correct, losses = (t[: len(tasks)].cpu().tolist() for t in (cohort.correct, cohort.loss_sum))
        for i, c, loss, (_, indices) in zip(positions, correct, losses, spans):
            n = len(indices)
            results[i] = EvalResult(int(c), n, loss / n if n else math.nan)

    def _evaluate_forwards(
        self,
        name: str,
        split: Split,
        tasks: list[EvalTask],
        spans: list[tuple[int, torch.Tensor]],
        results: list,
        positions: list[int],
    ) -> None:
        """As :meth:`_evaluate_cohort` for tasks with one :class:`~plfl.tasks.Forward`: ``vmap`` of the forward
        over the cohort's stacked models (the architecture's tensors and the method's own), batch after batch,
        each member's padded rows masked out (no recorded steps)."""
        width = max(1, EVAL_BATCH_SIZE // len(tasks))
        offsets = [offset for offset, _ in spans]
        index, mask, active = split.schedule(offsets, [padded_rows(indices, width) for _, indices in spans])
        rows = index - torch.tensor(offsets, device=index.device).view(1, -1, 1)  # indices in each client's split
        params = stack([t.params for t in tasks], self.device)
        predict = vmap(partial(tasks[0].forward, self.stacked_steps.network))
        correct = torch.zeros(len(tasks), device=self.device)
        loss_sum = torch.zeros(len(tasks), device=self.device)
        with torch.no_grad():
            for s, k in enumerate(active):
                logits = predict({key: v[:k] for key, v in params.items()}, split.x[index[s, :k]], rows[s, :k])
                y, real = split.y[index[s, :k]], mask[s, :k]
                correct[:k] += ((logits.argmax(-1) == y) * real).sum(1)
                loss_sum[:k] += (F.cross_entropy(logits.transpose(1, 2), y, reduction="none") * real).sum(1)
        for i, c, loss, (_, indices) in zip(positions, correct.cpu().tolist(), loss_sum.cpu().tolist(), spans):
            n = len(indices)
            results[i] = EvalResult(round(c), n, loss / n if n else math.nan)

    def _evaluation_step(self, cohort: CohortState, split: Split, width: int, k: int) -> None:
        """The correct predictions and summed cross-entropy of the cohort's first ``k`` members on their batches
        of ``split`` in ``cohort.batch(width)``, added to ``cohort.correct`` and ``cohort.loss_sum``."""
        index, mask = (t[:k] for t in cohort.batch(width))
        with torch.no_grad():
            logits = vmap(partial(functional_call, self.model, strict=True))(
                first_rows(cohort.state, k), (split.x[index],)
            )
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

    @cached_property
    def val_split(self) -> Split:
        return Split.of([(c.x_val, c.y_val) for c in self.data.clients], self.device)

    def _cohort_state(self, size: int) -> CohortState:
        """The stacked state that cohorts share, replaced by a larger one (and the recorded steps, which read
        the old one, forgotten) when ``size`` clients do not fit."""
        if self.cohort is None or self.cohort.capacity < size:
            self.graphs.clear()
            self.cohort = None  # the old tensors go before the new ones come
            self.cohort = CohortState(
                self.model.state_dict(),
                [n for n, _ in self.model.named_parameters()],
                size,
                self.device,
                bool(self.momentum),
            )
        return self.cohort

    def _cohorts(self, order: list[int]) -> list[list[int]]:
        size = self.cohort_size or max(len(order), 1)
        return [order[i : i + size] for i in range(0, len(order), size)]

    def _fall_back(self, reason: str, run, tasks: list):
        if tasks and reason not in self.noticed:
            self.noticed.add(reason)
            warnings.warn(
                PlflWarning(f"federation.executor=vectorized runs this work on the sequential executor: {reason}."),
                stacklevel=3,
            )
        return run(tasks)


def _same_tensors(kept: list[tuple[torch.Tensor, ...]], data: list[tuple[torch.Tensor, ...]]) -> bool:
    """Whether ``data`` holds the very tensor objects of ``kept``, in order."""
    return len(kept) == len(data) and all(a is b for old, new in zip(kept, data) for a, b in zip(old, new))


def _length(rows: torch.Tensor | list[torch.Tensor]) -> int:
    """How many batches ``rows`` holds: a table's rows, or the first epoch's of a list of epochs."""
    return len(rows) if isinstance(rows, torch.Tensor) else (len(rows[0]) if rows else 0)
