"""A SuperNode's side: its clients' hooks and tasks on its own data, their state kept on the node.

A node's data is its own, never the server's: with ``data-dir`` in its ``node_config`` (``flower-supernode
--node-config "data-dir=PATH"``), the files ``plfl flower split`` wrote for it (:mod:`plfl.flower.node_data`);
otherwise the clients ``partition-id, partition-id + num-partitions, ...`` of the config's ``data`` section, loaded on
its own machine (Flower's simulation runtime sets both keys). It answers the server's requests with a
:class:`~plfl.client_side.LocalClients` of its own: the method's client hooks over a store of its clients' state.
That state and the messages its clients received last persist in the node's Flower context
(``context.state``) between requests and, with a state directory (``state-dir`` in the node config), on the node's
disk after each broadcast (``round-R.pt``, the last two kept), so that a run resumed from the server's checkpoint of
round R continues from the nodes' state of round R.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from omegaconf import DictConfig, OmegaConf

from plfl.checkpoint import checkpoint_path, read_checkpoint, save_checkpoint
from plfl.client_side import LocalClients
from plfl.config import ExperimentConfig
from plfl.data import FederatedData, load_federated_data
from plfl.data.federated import ClientData
from plfl.errors import ConfigError, PlflError
from plfl.executors import build_executor
from plfl.flower.node_data import read_node_data
from plfl.flower.records import CONFIG, config_of, models_of
from plfl.methods import build_method, method_class
from plfl.methods.base import FederationContext
from plfl.models import models
from plfl.state import ClientStateStore, Params
from plfl.tasks import ClientFailure, EvalResult

STATE = "plfl"


def node_clients(node_config: dict[str, Any], num_clients: int) -> list[int]:
    """The clients a node holds: ``partition-id`` + k · ``num-partitions`` for k = 0, 1, ... below ``num_clients``.

    Raises:
        ConfigError: the node config lacks the keys (and has no ``data-dir``), or ``partition-id`` is outside
            0..num-partitions − 1.
    """
    try:
        partition, partitions = int(node_config["partition-id"]), int(node_config["num-partitions"])
    except KeyError as missing:
        raise ConfigError(
            f"A plfl SuperNode needs {missing} in its node config: start it with "
            '--node-config "partition-id=K num-partitions=P" (its clients: K, K + P, ...), or with '
            '--node-config "data-dir=PATH" (the files plfl flower split wrote for it).'
        ) from None
    if not 0 <= partition < partitions:
        raise ConfigError(f"partition-id={partition} is outside 0..{partitions - 1} (num-partitions={partitions}).")
    return list(range(partition, num_clients, partitions))


def only(data: FederatedData, clients: list[int]) -> FederatedData:
    """``data`` with every client outside ``clients`` emptied (0 samples): a node keeps its own clients' data."""
    kept = set(clients)

    def empty(c: ClientData) -> ClientData:
        return ClientData(c.x_train[:0].clone(), c.y_train[:0].clone(), c.x_test[:0].clone(), c.y_test[:0].clone())

    return dataclasses.replace(data, clients=[c if i in kept else empty(c) for i, c in enumerate(data.clients)])


class Node:
    """The clients of one SuperNode under the run's config ``cfg`` (validated), from ``node_config``; its state
    directory is ``state-dir`` there, else ``state_root``/node-``partition-id`` (None: no state on disk).

    Raises:
        ConfigError, DataError: as :func:`plfl.experiment.run_experiment` for the same config.
    """

    def __init__(self, cfg: DictConfig, node_config: dict[str, Any], state_root: Optional[Path] = None):
        config: ExperimentConfig = OmegaConf.to_object(cfg)
        L.seed_everything(config.federation.seed, verbose=False)  # the initial model the server draws too
        if "data-dir" in node_config:
            data, self.clients = read_node_data(Path(str(node_config["data-dir"])))
        else:
            data = load_federated_data(config.data, config.federation.seed)
            self.clients = node_clients(node_config, len(data.clients))
            data = only(data, self.clients)
        model = models()[config.model.name].of(config.model).build(data.input_shape, data.num_classes, data.vocab_size)
        model = method_class(config.method.name).client_network(model)
        initial_params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.store = ClientStateStore(len(data.clients))
        context = FederationContext(data, self.store, config.federation, model, config.data.augment, config.aggregation)
        method = build_method(config.method, context, initial_params)
        executor = build_executor(config.work, config.executor_options, data, model)
        self.local = LocalClients(method, self.store, executor)
        self.data = data
        self.received: dict[int, Optional[Params]] = {}  # each client's message of the last broadcast
        self.state_dir: Optional[Path] = None
        if "state-dir" in node_config:
            self.state_dir = Path(str(node_config["state-dir"]))
        elif state_root is not None:
            self.state_dir = state_root / f"node-{node_config['partition-id']}"

    def describe(self) -> ConfigRecord:
        """The node's clients and their split sizes, and what the server needs of the data's shape."""
        own = [self.data.clients[i] for i in self.clients]
        return ConfigRecord(
            {
                "clients": self.clients,
                "num_train": [c.num_train for c in own],
                "num_val": [c.num_val for c in own],
                "num_test": [c.num_test for c in own],
                "name": self.data.name,
                "num_classes": self.data.num_classes,
                "input_shape": list(self.data.input_shape),
                "vocab_size": -1 if self.data.vocab_size is None else self.data.vocab_size,
            }
        )

    def handle(self, message: Message, context: Context) -> Message:
        """Answer one request (its ``message_type``), the clients' state read from and written back to
        ``context.state``."""
        kind = message.metadata.message_type
        if kind == "query.describe":
            resume = int(config_of(message.content)["resume"])
            if resume >= 0:
                self._restore(resume, context)
            return Message(RecordDict({CONFIG: self.describe()}), reply_to=message)
        self._load(context)
        request = config_of(message.content)
        clients = list(request["clients"])
        round_ = int(request["round"])
        reply = RecordDict()
        if kind == "query.initialise":
            messages = dict(zip(clients, models_of(message.content)))
            failures = self.local.initialise(round_, messages)
            self.received.update(messages)
            if self.state_dir is not None:
                save_checkpoint(self.state_dir, round_, self._state(), keep=2)
            failed = {c: f for c, f in failures.items() if f is not None}
            done: dict[int, dict[str, Any]] = {c: {} for c, f in failures.items() if f is None}
            for split in request["evaluate"]:  # the new models, in a round that evaluates
                for client, row in evaluated(list(done), self.local.evaluate(list(done), split)).items():
                    done[client].update({f"{split}.{key}": value for key, value in row.items()})
        elif kind == "train":
            updates = self.local.train(round_, clients, {c: self.received.get(c) for c in clients}, {})
            done, failed = {}, {}
            for client_id, update in zip(clients, updates):
                if isinstance(update, ClientFailure):
                    failed[client_id] = update
                    continue
                done[client_id] = {"loss": update.result.loss, "samples": update.result.samples_seen}
                if update.message is not None:
                    reply[f"upload.{client_id}"] = ArrayRecord(torch_state_dict=update.message)
        elif kind == "evaluate":
            done = evaluated(clients, self.local.evaluate(clients, request["split"]))
            failed = {}
        elif kind == "evaluate.models":
            done = evaluated(clients, self.local.evaluate_models(clients, models_of(message.content)))
            failed = {}
        else:
            raise ValueError(f"a plfl SuperNode has no request {kind!r}")
        self._save(context)
        reply[CONFIG] = ConfigRecord(
            {
                "clients": list(done),
                **{key: [row[key] for row in done.values()] for key in next(iter(done.values()), {})},
                "failed": list(failed),
                "reasons": [f.reason for f in failed.values()],
            }
        )
        return Message(reply, reply_to=message)

    def _load(self, context: Context) -> None:
        record = context.state.get(STATE)
        if record is None:
            return
        state = torch.load(io.BytesIO(record["state"]), weights_only=True)
        self.store.load_state_dict(state["store"])
        self.received = state["received"]

    def _state(self) -> dict[str, Any]:
        return {"store": self.store.state_dict(), "received": self.received}

    def _save(self, context: Context) -> None:
        buffer = io.BytesIO()
        torch.save(self._state(), buffer)
        context.state[STATE] = ConfigRecord({"state": buffer.getvalue()})

    def _restore(self, round_: int, context: Context) -> None:
        """The clients' state of the broadcast of ``round_``, from the state directory, into ``context``.

        Raises:
            PlflError: no state directory, or no intact state of that round in it.
        """
        path = None if self.state_dir is None else checkpoint_path(self.state_dir, round_)
        if path is None or not path.is_file():
            raise PlflError(
                f"this SuperNode cannot resume round {round_}: "
                + ("it has no state-dir in its node config" if path is None else f"{path} does not exist")
                + ". Its clients' state is needed to continue; start the run anew, or restart the node with the "
                "state-dir it had."
            )
        state = read_checkpoint(path)
        self.store.load_state_dict(state["store"])
        self.received = state["received"]
        self._save(context)


def evaluated(clients: list[int], results: list[EvalResult]) -> dict[int, dict[str, Any]]:
    """Each client's evaluation as a reply row."""
    return {c: {"correct": r.correct, "total": r.total, "loss": r.loss} for c, r in zip(clients, results)}
