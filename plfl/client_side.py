"""The clients' side of a round: the method's client hooks on each client's state, their tasks through an executor.

The federation loop keeps the server's books and asks a :class:`ClientSide` for what clients do: train the sampled
clients (``local_train``, ``post_train``, ``client_message``), initialise every client from the server's message
(``pre_local_init``) and evaluate the clients' models or given ones. :class:`LocalClients` does it in this process,
every client's hooks together through one executor (simulation); :mod:`plfl.flower` sends the same requests to
Flower SuperNodes, each of which answers them with a :class:`LocalClients` of its own over its own clients' data and
store. Either way a client's work, its seeds and so its numbers are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from plfl.data.federated import FederatedData
from plfl.executors.base import Executor, drive
from plfl.methods.base import Method
from plfl.seeding import derive_seed
from plfl.state import ClientStateStore, Params
from plfl.system import SystemSimulation
from plfl.tasks import ClientFailure, EvalResult, EvalTask, TrainResult, TrainTask, Work, finite_or_failure, resolved


@dataclass(frozen=True)
class Update:
    """A sampled client's round of training as the server receives it."""

    result: Optional[TrainResult]  # None: (system simulation) the client left no mini-batch before the deadline
    message: Optional[Params]  # its upload (Method.client_message); None: it sends nothing
    processed: int = 0  # system simulation: the training samples it processed
    cut: bool = False  # system simulation: whether one of its training tasks was cut short


@dataclass(frozen=True)
class ClientUnreachable(ClientFailure):
    """A client whose device did not answer (its SuperNode down, or too slow for the request's timeout): the loop
    leaves it out of a round's training, broadcast or evaluation and goes on."""


class ClientSide(Protocol):
    """Where the clients' hooks and tasks run (:class:`LocalClients`, or Flower's SuperNodes)."""

    def train(
        self, round_: int, clients: list[int], received: dict[int, Optional[Params]], budgets: dict[int, Any]
    ) -> list[Update | ClientFailure]:
        """Each client's round of training, in order: its ``local_train`` from its model and the message it
        received at the last broadcast (``received``), ``post_train``, then ``client_message``; its trained model
        replaces its own. ``budgets``: with a system simulation, each client's samples before the deadline."""

    def initialise(self, round_: int, messages: dict[int, Optional[Params]]) -> dict[int, Optional[ClientFailure]]:
        """Every client in ``messages`` initialises its model from the server's message (``pre_local_init``);
        a failure per client whose initialisation failed (:class:`ClientUnreachable`: it did not answer), else
        None."""

    def evaluate(self, clients: Sequence[int], split: str) -> list[EvalResult | ClientUnreachable]:
        """Each client's own model on its ``split``: "test", "val", or "triggered" (its test images with the
        backdoor's trigger), predicting by the method's :meth:`~plfl.methods.base.Method.prediction`."""

    def evaluate_models(self, clients: Sequence[int], models: Sequence[Params]) -> list[EvalResult | ClientUnreachable]:
        """``models[k]`` (e.g. the global model) on client ``clients[k]``'s test split, by the architecture's
        forward pass."""

    def fine_tune(
        self, round_: int, clients: Sequence[int], model: Params, epochs: int
    ) -> list[Params | ClientFailure]:
        """``model`` after ``epochs`` epochs on each of ``clients``' training splits: unseen clients joining
        (``federation.unseen_clients``)."""


class RemoteClients(ClientSide, Protocol):
    """A clients' side in other processes (:class:`plfl.flower.server.FlowerClients`), which holds the data."""

    def federated_data(self) -> FederatedData:
        """The federation as the server sees it: the clients' sample counts and the data's shape."""


class LocalClients:
    """The clients' side in this process: ``method``'s client hooks on ``store``, their tasks through ``executor``.

    ``system``: the simulated client systems (``federation.system``) that cut a client's training at its
    deadline; ``triggered``: the executor's id of client 0's triggered test images (a backdoor attack), the
    others' following.
    """

    def __init__(
        self,
        method: Method,
        store: ClientStateStore,
        executor: Executor,
        system: Optional[SystemSimulation] = None,
        triggered: Optional[int] = None,
    ):
        self.method = method
        self.store = store
        self.executor = executor
        self.system = system
        self.triggered = triggered

    def train(
        self, round_: int, clients: list[int], received: dict[int, Optional[Params]], budgets: dict[int, Any]
    ) -> list[Update | ClientFailure]:
        outcomes = drive([self._round(c, received.get(c), round_, budgets.get(c)) for c in clients], self.executor)
        updates: list[Update | ClientFailure] = []
        for client_id, outcome in zip(clients, outcomes):
            processed, cut = 0, False
            if self.system is not None and not isinstance(outcome, ClientFailure):
                outcome, processed, cut = outcome
                if outcome is None:
                    updates.append(Update(None, None, processed, cut))
                    continue
            result = outcome if isinstance(outcome, ClientFailure) else finite_or_failure(outcome)
            if isinstance(result, ClientFailure):
                updates.append(result)
                continue
            self.store.set(client_id, "model", result.params)
            updates.append(Update(result, self.method.client_message(client_id, result, round_), processed, cut))
        return updates

    def _round(self, client_id: int, message: Optional[Params], round_: int, budget: Any) -> Work[Any]:
        """The client's local training (from its model and ``message``) and post-training step, as one hook for
        :func:`drive`; with a system simulation, metered (:meth:`~plfl.system.SystemSimulation.metered`): (value,
        samples, cut)."""

        def work() -> Work[TrainResult]:
            model = self.store.get(client_id, "model")
            result = yield from resolved(self.method.local_train(client_id, model, message, round_))
            return (yield from resolved(self.method.post_train(client_id, result, round_)))

        if self.system is None:
            return (yield from work())
        return (yield from self.system.metered(client_id, work(), budget))

    def initialise(self, round_: int, messages: dict[int, Optional[Params]]) -> dict[int, Optional[ClientFailure]]:
        hooks = [resolved(self.method.pre_local_init(c, m, round_)) for c, m in messages.items()]
        failures: dict[int, Optional[ClientFailure]] = {}
        for client_id, model in zip(messages, drive(hooks, self.executor)):
            if isinstance(model, ClientFailure):
                failures[client_id] = model
            else:
                self.store.set(client_id, "model", model)
                failures[client_id] = None
        return failures

    def evaluate(self, clients: Sequence[int], split: str) -> list[EvalResult]:
        forward = self.method.prediction()
        models = [self.store.get(i, "model") for i in clients]
        if split == "triggered":
            return self.executor.evaluate(
                [EvalTask(self.triggered + i, m, forward=forward) for i, m in zip(clients, models)]
            )
        return self.executor.evaluate([EvalTask(i, m, split=split, forward=forward) for i, m in zip(clients, models)])

    def evaluate_models(self, clients: Sequence[int], models: Sequence[Params]) -> list[EvalResult]:
        return self.executor.evaluate([EvalTask(i, m) for i, m in zip(clients, models)])

    def fine_tune(
        self, round_: int, clients: Sequence[int], model: Params, epochs: int
    ) -> list[Params | ClientFailure]:
        return drive([self._join(c, model, round_, epochs) for c in clients], self.executor)

    def _join(self, client_id: int, model: Params, round_: int, epochs: int) -> Work[Params]:
        if not epochs:
            return model
        seed = derive_seed(self.method.seed, round_, client_id, "unseen_finetuning")
        result = yield TrainTask(client_id, model, seed, epochs=epochs)
        failure = finite_or_failure(result)
        return failure if isinstance(failure, ClientFailure) else result.params
