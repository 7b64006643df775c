"""The server's side of a Flower run: the clients' side of each round (:class:`~plfl.client_side.ClientSide`) as
messages to the SuperNodes that hold the clients.

At the start every node says which clients it holds and their split sizes (``query.describe``); the server builds
from that a :class:`~plfl.data.FederatedData` whose tensors have shapes but no values (PyTorch's ``meta``
device): the loop and the method's server side see each client's sample counts, and reading a sample raises.
Each phase of a round then sends one message per node with its clients' part: ``query.initialise`` (the
broadcast), ``train``, ``evaluate`` (the clients' own models) and ``evaluate.models`` (given models). A node that
does not answer in time, or answers with an error (its ClientApp raised, or Flower lost it), leaves its clients
unreachable (:class:`~plfl.client_side.ClientUnreachable`) with that reason; a failure a node reports for a client
(its training diverged) is that client's :class:`~plfl.tasks.ClientFailure`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from omegaconf import DictConfig, OmegaConf

from plfl.client_side import ClientUnreachable, Update
from plfl.data import FederatedData
from plfl.data.federated import ClientData
from plfl.errors import PlflError
from plfl.flower.records import CONFIG, config_of, with_models
from plfl.state import Params
from plfl.tasks import ClientFailure, EvalResult, TrainResult


class FlowerClients:
    """The clients of the SuperNodes connected to ``grid``, for a run over ``num_nodes`` of them; ``timeout``: the
    seconds to wait for a request's replies (None: until every node answered; the first request waits ``wait``
    seconds at least, for the nodes' ClientApps to start); ``resume``: the round whose state
    the nodes restore (a run resumed from the server's checkpoint of that round); ``config``: the run's config,
    sent to the nodes with the first request (None: the nodes have their own).

    Raises:
        PlflError: fewer than ``num_nodes`` nodes connected within ``wait`` seconds, a node could not describe its
            clients (or restore ``resume``'s state), or their clients are not 0..N−1 once each.
    """

    def __init__(
        self,
        grid: Grid,
        num_nodes: int,
        timeout: Optional[float] = None,
        wait: float = 60.0,
        resume: Optional[int] = None,
        config: Optional[DictConfig] = None,
    ):
        self.grid = grid
        self.timeout = timeout
        deadline = time.monotonic() + wait
        nodes = list(grid.get_node_ids())
        while len(nodes) < num_nodes and time.monotonic() < deadline:
            time.sleep(1.0)
            nodes = list(grid.get_node_ids())
        if len(nodes) < num_nodes:
            raise PlflError(
                f"{len(nodes)} of the {num_nodes} SuperNodes connected within {wait:.0f} s. Start the missing "
                "ones (flower-supernode ... --node-config 'partition-id=K num-partitions=P' or 'data-dir=...'), or "
                "wait for fewer (plfl flower run --nodes N; nodes = N in the app's run config)."
            )
        request: dict[str, Any] = {"resume": -1 if resume is None else resume}
        if config is not None:
            request["config"] = OmegaConf.to_yaml(config, resolve=True)
        # A node's first answer waits for its ClientApp to start (import torch, load its data): up to ``wait`` s.
        first = None if timeout is None else max(timeout, wait)
        replies = self._send({node: with_models(request, []) for node in nodes[:num_nodes]}, "query.describe", first)
        self.owner: dict[int, int] = {}  # client → its node
        self.described: dict[int, Any] = {}
        for node, reply in replies.items():
            if isinstance(reply, str):
                raise PlflError(f"SuperNode {node} could not describe its clients: {reply}")
            for client in reply["clients"]:
                if client in self.owner:
                    raise PlflError(
                        f"client {client} is on SuperNodes {self.owner[client]} and {node}: give each node its own "
                        "partition-id"
                    )
                self.owner[client] = node
            self.described[node] = reply
        # The splits the nodes evaluate with each broadcast of a round that evaluates (the config's eval_every).
        self.evaluated: dict[tuple[str, int], EvalResult | ClientUnreachable] = {}
        self.evaluated_round = -1
        self.evaluates: Callable[[int], bool] = lambda round_: False
        self.splits = ["test"] + (["val"] if any(sum(r["num_val"]) for r in self.described.values()) else [])
        if config is not None:
            every, rounds = config.federation.eval_every, config.federation.rounds
            self.evaluates = lambda round_: round_ % every == 0 or round_ == rounds
        missing = sorted(set(range(len(self.owner))) ^ set(self.owner))
        if missing:
            raise PlflError(
                f"the SuperNodes hold clients {sorted(self.owner)}, not 0..N−1 (wrong: {missing}): start "
                f"{num_nodes} nodes with partition-id 0..{num_nodes - 1} and num-partitions={num_nodes}."
            )

    def federated_data(self) -> FederatedData:
        """The federation's shape and sample counts, its tensors on the ``meta`` device (no values)."""
        first = next(iter(self.described.values()))
        shape = tuple(first["input_shape"])
        vocab = None if first["vocab_size"] < 0 else first["vocab_size"]
        dtype = torch.float32 if vocab is None else torch.int64
        sizes: dict[int, tuple[int, int, int]] = {}
        for reply in self.described.values():
            sizes.update(zip(reply["clients"], zip(reply["num_train"], reply["num_val"], reply["num_test"])))

        def split(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.empty((n, *shape), dtype=dtype, device="meta")
            return x, torch.empty(n, dtype=torch.int64, device="meta")

        clients = []
        for client in range(len(sizes)):
            train, val, test = sizes[client]
            clients.append(ClientData(*split(train), *split(test), *split(val)))
        return FederatedData(first["name"], clients, first["num_classes"], shape, vocab)

    def train(
        self, round_: int, clients: list[int], received: dict[int, Optional[Params]], budgets: dict[int, Any]
    ) -> list[Update | ClientFailure]:
        replies = self._per_node(clients, {"round": round_}, "train")
        updates: list[Update | ClientFailure] = []
        for client in clients:
            row = replies[client]
            if isinstance(row, ClientFailure):
                updates.append(row)
                continue
            reply, values = row
            upload = reply.get(f"upload.{client}")
            message = None if upload is None else upload.to_torch_state_dict()
            result = TrainResult(message or {}, values["loss"], values["samples"])
            updates.append(Update(result, message))
        return updates

    def initialise(self, round_: int, messages: dict[int, Optional[Params]]) -> dict[int, Optional[ClientFailure]]:
        # In a round that evaluates, the nodes evaluate the new models in the same exchange: the loop asks for
        # nothing in between, and an exchange costs seconds on Flower.
        splits = self.splits if self.evaluates(round_) else []
        replies = self._per_node(list(messages), {"round": round_, "evaluate": splits}, "query.initialise", messages)
        if round_ != self.evaluated_round:  # a broadcast in groups (federation.state_offload) adds to its round's
            self.evaluated, self.evaluated_round = {}, round_
        for client, row in replies.items():
            for split in splits:
                if isinstance(row, ClientUnreachable):
                    self.evaluated[split, client] = row
                elif not isinstance(row, ClientFailure):
                    values = row[1]
                    self.evaluated[split, client] = EvalResult(
                        values[f"{split}.correct"], values[f"{split}.total"], values[f"{split}.loss"]
                    )
        return {c: r if isinstance(r, ClientFailure) else None for c, r in replies.items()}

    def evaluate(self, clients: Sequence[int], split: str) -> list[EvalResult | ClientUnreachable]:
        if all((split, c) in self.evaluated for c in clients):
            return [self.evaluated.pop((split, c)) for c in clients]
        return self._evaluations(self._per_node(list(clients), {"round": -1, "split": split}, "evaluate"), clients)

    def evaluate_models(self, clients: Sequence[int], models: Sequence[Params]) -> list[EvalResult | ClientUnreachable]:
        replies = self._per_node(list(clients), {"round": -1}, "evaluate.models", dict(zip(clients, models)))
        return self._evaluations(replies, clients)

    def fine_tune(self, round_: int, clients: Sequence[int], model: Params, epochs: int) -> list[Params]:
        raise PlflError("a Flower run has no unseen clients: they are simulated in one process (plfl fit)")

    def _evaluations(self, replies: dict[int, Any], clients: Sequence[int]) -> list[EvalResult | ClientUnreachable]:
        results: list[EvalResult | ClientUnreachable] = []
        for client in clients:
            row = replies[client]
            if isinstance(row, ClientFailure):  # a node reports no evaluation failures: it did not answer
                results.append(ClientUnreachable(row.reason))
                continue
            values = row[1]
            results.append(EvalResult(values["correct"], values["total"], values["loss"]))
        return results

    def _per_node(
        self,
        clients: list[int],
        config: dict[str, Any],
        kind: str,
        models: Optional[dict[int, Optional[Params]]] = None,
    ) -> dict[int, tuple[RecordDict, dict[str, Any]] | ClientFailure]:
        """One ``kind`` request per node holding some of ``clients`` (with their ``models``); each client's reply
        (the node's records and the client's row) or failure."""
        by_node: dict[int, list[int]] = {}
        for client in clients:
            by_node.setdefault(self.owner[client], []).append(client)
        requests = {}
        for node, own in by_node.items():
            request = {**config, "clients": own}
            requests[node] = with_models(request, [models[c] for c in own] if models else [])
        replies = self._send(requests, kind, self.timeout)
        rows: dict[int, tuple[RecordDict, dict[str, Any]] | ClientFailure] = {}
        for node, own in by_node.items():
            reply = replies[node]
            if isinstance(reply, str):
                rows.update({c: ClientUnreachable(f"SuperNode {node}: {reply}") for c in own})
                continue
            content, table = reply
            keys = [k for k in table if k not in ("clients", "failed", "reasons")]
            for i, client in enumerate(table["clients"]):
                rows[client] = content, {k: table[k][i] for k in keys}
            for client, reason in zip(table["failed"], table["reasons"]):
                rows[client] = ClientFailure(reason)
            for client in own:
                rows.setdefault(client, ClientUnreachable(f"SuperNode {node} did not report client {client}"))
        return rows

    def _send(self, requests: dict[int, RecordDict], kind: str, timeout: Optional[float]) -> dict[int, Any]:
        """Each node's reply to its request (within ``timeout`` s; None: no limit): its
        records and config (``query.describe``: the config alone), or why it gave none."""
        messages = {node: Message(content, dst_node_id=node, message_type=kind) for node, content in requests.items()}
        replies: dict[int, Any] = {node: "no reply in time" for node in requests}
        answered = self.grid.send_and_receive(list(messages.values()), timeout=timeout)
        # The grid gives each message its id as it sends it; the SuperLink answers for a node it lost (error code 5,
        # from its own id), so a reply is matched to its request, not to its sender.
        node_of = {message.metadata.message_id: node for node, message in messages.items()}
        for reply in answered:
            node = node_of[reply.metadata.reply_to_message_id]
            if reply.has_error():
                replies[node] = reply.error.reason
            elif kind == "query.describe":
                replies[node] = config_of(reply.content)
            else:
                replies[node] = reply.content, reply.content[CONFIG]
        return replies
