"""The Ray executor (``federation.executor=ray``): a round's client tasks spread over a pool of Ray actors.

Each actor is a :class:`ClientWorker`: a :class:`~plfl.executors.sequential.SequentialExecutor` (one
ClientModule on one reused Lightning Trainer) over the run's data, which the driver puts into Ray's object
store once per run. Per call the driver sends each task (client id, parameters, seed, options; a step task's
``shared`` tensors once per call, not per task) to the next idle actor and returns the results in task order,
whatever order the actors finish in, so the server aggregates exactly as with ``sequential``. Method hooks,
server state, the client-state store and the callbacks stay in the driver. An actor that dies during a task is
replaced and the task runs once more on the fresh actor; a second death makes it a failed client.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from plfl.activity import current as activity
from plfl.cluster import connect, import_ray, wait
from plfl.data.federated import FederatedData
from plfl.errors import ConfigError, FederationError, PlflError
from plfl.executors.sequential import SequentialExecutor
from plfl.state import Params
from plfl.tasks import (
    ClientFailure,
    EvalResult,
    EvalTask,
    FeatureResult,
    FeatureTask,
    StepResult,
    StepTask,
    TrainResult,
    TrainTask,
    shared_identity,
)

if TYPE_CHECKING:
    from plfl.executors.options import ClientWorkOptions, Ray


class ClientWorker:
    """The body of one Ray actor: runs single tasks on its own sequential executor (on one device) over ``data``."""

    def __init__(self, work: ClientWorkOptions, data: FederatedData, architecture: nn.Module, num_threads: int):
        torch.set_num_threads(num_threads)
        self.executor = SequentialExecutor.of(work, data, architecture, devices=1)

    def ready(self) -> bool:
        """True once the actor is built: the driver waits on it so that start-up errors come before training."""
        return True

    def train(self, task: TrainTask) -> TrainResult | ClientFailure:
        return self.executor.train([task])[0]

    def step(self, task: StepTask, shared: Params) -> StepResult | ClientFailure:
        return self.executor.step([dataclasses.replace(task, shared=shared)])[0]

    def features(self, task: FeatureTask) -> FeatureResult | ClientFailure:
        return self.executor.features([task])[0]

    def evaluate(self, task: EvalTask) -> EvalResult:
        return self.executor.evaluate([task])[0]


class RayExecutor:
    """Runs tasks on ``options.num_actors`` Ray actors, connecting to Ray at ``options.address`` (see
    :func:`plfl.cluster.connect`); :meth:`close` releases them.

    Raises:
        ConfigError: Ray is not installed, the address cannot be reached, or the cluster has fewer CPUs or
            GPUs than the actors ask for.
        PlflError: an actor could not start (e.g. plfl is missing on a cluster node).
    """

    worker = ClientWorker  # the actors' class

    def __init__(self, options: Ray, work: ClientWorkOptions, data: FederatedData, architecture: nn.Module):
        self.ray = import_ray("federation.executor=ray")
        self.options = options
        self.actors: list[Any] = []
        self.started = connect(self.ray, options.address, options.num_actors * options.num_cpus_per_actor)
        try:
            self._check_resources()
            self.actor_class = self.ray.remote(self.worker).options(
                num_cpus=options.num_cpus_per_actor, num_gpus=options.num_gpus_per_actor
            )
            # Data and model go into the object store once; every actor, replacements too, reads them from there.
            self.args = (
                work,
                self.ray.put(data),
                self.ray.put(architecture),
                max(1, int(options.num_cpus_per_actor)),
            )
            self.actors = [self.actor_class.remote(*self.args) for _ in range(options.num_actors)]
            for _, outcome in wait(self.ray, [actor.ready.remote() for actor in self.actors], len(self.actors)):
                if isinstance(outcome, Exception):
                    raise outcome
        except self.ray.exceptions.RayActorError as error:
            self.close()
            raise PlflError(
                f"The Ray actors of federation.executor=ray could not start: {_first_line(error)}. "
                "Every node of the cluster needs plfl and its dependencies installed (the versions "
                "here)."
            ) from None
        except BaseException:
            self.close()
            raise

    def train(self, tasks: list[TrainTask]) -> list[TrainResult | ClientFailure]:
        return self._run("train", tasks, lambda task, reason: ClientFailure(reason))

    def step(self, tasks: list[StepTask]) -> list[StepResult | ClientFailure]:
        """Each task's ``shared`` tensors go into the object store once per distinct set of tensors."""
        refs = {shared_identity(t): self.ray.put(t.shared) for t in tasks}
        calls = [(dataclasses.replace(t, shared={}), refs[shared_identity(t)]) for t in tasks]
        return self._run("step", calls, lambda call, reason: ClientFailure(reason))

    def features(self, tasks: list[FeatureTask]) -> list[FeatureResult | ClientFailure]:
        return self._run("features", tasks, lambda task, reason: ClientFailure(reason))

    def evaluate(self, tasks: list[EvalTask]) -> list[EvalResult]:
        def fail(task: EvalTask, reason: str) -> EvalResult:
            raise FederationError(
                f"The evaluation of client {task.client_id} failed: {reason}. Continue with plfl fit "
                "--resume RUN_DIR once the cluster is healthy."
            )

        return self._run("evaluate", tasks, fail)

    def close(self) -> None:
        """Disconnect from Ray if this executor connected (a local Ray stops), else kill its actors."""
        if self.started:
            self.ray.shutdown()
            self.started = False
        else:
            for actor in self.actors:
                self.ray.kill(actor)
        self.actors = []

    def _run(self, method: str, tasks: list, fail: Callable[[Any, str], Any]) -> list:
        """Each task (or tuple of arguments) on the next idle actor; results in task order. A task whose actor
        dies is retried once on a fresh actor, then gets ``fail(task, reason)``."""
        results: list[Any] = [None] * len(tasks)
        work = {"train": "training", "features": "features", "evaluate": "evaluation"}.get(method) or (
            tasks[0][0].step.work if tasks else ""
        )
        activity.start_work(work, len(tasks))
        queue, idle = deque(range(len(tasks))), deque(range(len(self.actors)))
        running: dict[Any, tuple[int, int]] = {}  # ObjectRef → (actor slot, task index)
        died: set[int] = set()
        while queue or running:
            while queue and idle:
                slot, i = idle.popleft(), queue.popleft()
                args = tasks[i] if isinstance(tasks[i], tuple) else (tasks[i],)
                running[getattr(self.actors[slot], method).remote(*args)] = (slot, i)
            ((ref, outcome),) = wait(self.ray, list(running))
            slot, i = running.pop(ref)
            idle.append(slot)
            if isinstance(outcome, self.ray.exceptions.RayActorError):
                self.ray.kill(self.actors[slot])  # it may be unreachable rather than dead
                self.actors[slot] = self.actor_class.remote(*self.args)
                if i not in died:
                    died.add(i)
                    queue.appendleft(i)
                    continue
                outcome = fail(tasks[i], f"its Ray actor died twice ({_first_line(outcome)})")
            elif isinstance(outcome, self.ray.exceptions.RayTaskError):
                if isinstance(outcome.cause, PlflError):
                    raise outcome.cause from None  # bad input or options: every client would fail the same way
                raise outcome
            results[i] = outcome
            activity.finish_clients()
        return results

    def _check_resources(self) -> None:
        total, o = self.ray.cluster_resources(), self.options
        for resource, key, per_actor in (
            ("CPU", "num_cpus_per_actor", o.num_cpus_per_actor),
            ("GPU", "num_gpus_per_actor", o.num_gpus_per_actor),
        ):
            if o.num_actors * per_actor > total.get(resource, 0):
                raise ConfigError(
                    f"ray.num_actors={o.num_actors} × ray.{key}={per_actor:g} asks for "
                    f"{o.num_actors * per_actor:g} {resource}s, but the Ray cluster has "
                    f"{total.get(resource, 0):g}. Lower ray.num_actors or ray.{key}, or add nodes."
                )


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
