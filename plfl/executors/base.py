"""The executor interface, and the driver that runs the methods' training hooks through an executor.

A method hook that trains is a generator function: ``result = yield
self.train_task(...)`` hands a :class:`~plfl.executors.tasks.TrainTask` to the
loop and receives its :class:`~plfl.client.TrainResult` (a
:class:`~plfl.executors.tasks.LocalAggregationTask`, ALA's weight learning,
receives an :class:`~plfl.methods.ala.ALAOutcome`); the hook's return value is
its result. :func:`drive` advances every client's hook of a phase together, so
that one executor call receives all clients' tasks of a step (the vectorized
executor runs them at once). Executors only train, aggregate locally and
evaluate: they never touch the method, the client-state store or the
callbacks.
"""

from __future__ import annotations

from typing import Generator, Optional, Protocol, TypeVar

from plfl.client import EvalResult, TrainResult
from plfl.errors import PlflError
from plfl.executors.tasks import ClientFailure, EvalTask, LocalAggregationTask, Trains, TrainTask, raised
from plfl.methods.ala import ALAOutcome

T = TypeVar("T")


class Executor(Protocol):
    """Runs client tasks; ``plfl.executors.build_executor`` picks one by ``federation.executor``."""

    def train(self, tasks: list[TrainTask]) -> list[TrainResult | ClientFailure]:
        """One outcome per task, in order: a failure for a task that raised (a ``PlflError`` propagates:
        bad input fails every client alike) or whose trained parameters hold NaN or Inf."""

    def aggregate_locally(self, tasks: list[LocalAggregationTask]) -> list[ALAOutcome | ClientFailure]:
        """One outcome per task, in order, failures as in :meth:`train`."""

    def evaluate(self, tasks: list[EvalTask]) -> list[EvalResult]:
        """One result per task, in order."""

    def close(self) -> None:
        """Release the executor's workers (the Ray executor's actors, and Ray if it started it); called once
        when the run ends, however it ends."""


def resolved(value: Trains[T] | T) -> Trains[T]:
    """A hook's return value as a generator: a training hook's own, or one that returns a plain hook's value."""
    if isinstance(value, Generator):
        return (yield from value)
    return value


def drive(hooks: list[Trains[T]], executor: Executor) -> list[T | ClientFailure]:
    """Run the clients' hooks in lock-step and return each one's value, in order.

    Each step gathers the task every unfinished hook waits on, runs them with
    one ``executor.train`` call (and one ``executor.aggregate_locally`` call for
    the ALA tasks) and sends each hook its result. A hook whose
    task failed is closed and gets that failure; one that raises gets
    :func:`~plfl.executors.tasks.raised` of the error.

    Raises:
        PlflError: raised by a hook or the executor (bad input or options).
    """
    outcomes: list[Optional[T | ClientFailure]] = [None] * len(hooks)
    waiting: dict[int, TrainTask | LocalAggregationTask] = {}
    runs = ((TrainTask, executor.train), (LocalAggregationTask, executor.aggregate_locally))

    def advance(i: int, result: Optional[TrainResult]) -> None:
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
        for kind, run in runs:
            indices = [i for i, task in waiting.items() if isinstance(task, kind)]
            results = run([waiting.pop(i) for i in indices]) if indices else []
            for i, result in zip(indices, results, strict=True):
                if isinstance(result, ClientFailure):
                    hooks[i].close()
                    outcomes[i] = result
                else:
                    advance(i, result)
    return outcomes
