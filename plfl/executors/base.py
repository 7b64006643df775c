"""The executor interface, and the driver that runs the methods' hooks through an executor.

A method hook that needs client work is a generator function: ``result = yield task`` hands a
:mod:`plfl.tasks` task to the loop and receives its result (``results = yield [task, ...]``: a list
of tasks, their results in order); the hook's return value is its result. :func:`drive` advances
every client's hook of a phase together, so that one executor call receives all clients' tasks of a
kind (the vectorized executor runs them at once). Executors only run tasks: they never touch the
method, the client-state store or the callbacks.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, TypeVar

from plfl.errors import PlflError
from plfl.tasks import (
    ClientFailure,
    EvalResult,
    EvalTask,
    FeatureResult,
    FeatureTask,
    StepResult,
    StepTask,
    Task,
    TrainResult,
    TrainTask,
    Work,
    raised,
)

T = TypeVar("T")


class Executor(Protocol):
    """Runs client tasks; ``plfl.executors.build_executor`` picks one by ``federation.executor``."""

    def train(self, tasks: list[TrainTask]) -> list[TrainResult | ClientFailure]:
        """One outcome per task, in order: a failure for a task that raised (a ``PlflError`` propagates:
        bad input fails every client alike) or whose trained parameters hold NaN or Inf."""

    def step(self, tasks: list[StepTask]) -> list[StepResult | ClientFailure]:
        """One outcome per task, in order, failures as in :meth:`train`."""

    def features(self, tasks: list[FeatureTask]) -> list[FeatureResult | ClientFailure]:
        """One outcome per task, in order, failures as in :meth:`train`."""

    def evaluate(self, tasks: list[EvalTask]) -> list[EvalResult]:
        """One result per task, in order."""

    def close(self) -> None:
        """Release the executor's workers (the Ray executor's actors, and Ray if it started it); called once
        when the run ends, however it ends."""


def runners(executor: Executor) -> dict[type, Callable[[list], list]]:
    """The executor's call for each kind of task."""
    return {
        TrainTask: executor.train,
        StepTask: executor.step,
        FeatureTask: executor.features,
        EvalTask: executor.evaluate,
    }


def drive(hooks: list[Work[T]], executor: Executor) -> list[T | ClientFailure]:
    """Run the clients' hooks in lock-step and return each one's value, in order.

    Each round of requests gathers the tasks every unfinished hook waits on and runs those of a kind with one
    executor call, then sends each hook its result (or list of results). A hook one of whose tasks failed is
    closed and gets that failure; one that raises gets :func:`~plfl.tasks.raised` of the error.

    Raises:
        PlflError: raised by a hook or the executor (bad input or options).
    """
    outcomes: list[Optional[T | ClientFailure]] = [None] * len(hooks)
    waiting: dict[int, Task | list[Task]] = {}

    def advance(i: int, result: Any) -> None:
        try:
            waiting[i] = hooks[i].send(result)
        except StopIteration as stop:
            outcomes[i] = stop.value
        except PlflError:
            raise
        except Exception as error:  # noqa: BLE001  one client's failure must not end the others
            outcomes[i] = raised(error)

    for i in range(len(hooks)):
        advance(i, None)
    while waiting:
        requests = dict(waiting)
        waiting.clear()
        items = [(i, k, task) for i, request in requests.items() for k, task in enumerate(_as_list(request))]
        results: dict[tuple[int, int], Any] = {}
        for kind, run in runners(executor).items():
            of_kind = [(i, k, task) for i, k, task in items if isinstance(task, kind)]
            if of_kind:
                for (i, k, _), result in zip(of_kind, run([task for *_, task in of_kind]), strict=True):
                    results[i, k] = result
        for i, request in requests.items():
            ordered = [results[i, k] for k in range(len(_as_list(request)))]
            failure = next((r for r in ordered if isinstance(r, ClientFailure)), None)
            if failure is not None:
                hooks[i].close()
                outcomes[i] = failure
            else:
                advance(i, ordered if isinstance(request, list) else ordered[0])
    return outcomes


def _as_list(request: Task | list[Task]) -> list[Task]:
    return request if isinstance(request, list) else [request]
