"""The Method interface: the hooks a federation loop calls each round.

A round, as :class:`plfl.federation.FederationLoop` runs it:

1. every sampled client: ``local_train`` → ``post_train`` → ``client_message``;
2. the server: ``aggregate`` of the received messages;
3. every client: ``server_message`` → ``pre_local_init`` (its model for the
   next round's training and for this round's evaluation).

A method overrides only the hooks its algorithm changes. ``pre_local_init``,
``local_train`` and ``post_train`` may train: written as generator functions,
they ``yield self.train_task(...)`` and receive the TrainResult (the loop runs
the tasks through its executor, every client's together); a plain function's
value is used as it is. A training hook that extends its parent's writes
``result = yield from super().local_train(...)``. The default hooks are
FedAvg's client side; ALA (FedALA) is switched on by ``method.ala`` for a
method that keeps the default ``pre_local_init`` and whose schema has that key
(``plfl.methods.schemas.FedAvgConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from plfl.client import LocalTrainer, TrainResult
from plfl.config import FederationConfig
from plfl.data import FederatedData
from plfl.errors import ConfigError
from plfl.executors.tasks import LocalAggregationTask, Trains, TrainTask
from plfl.methods.ala import top_names
from plfl.methods.schemas import ALAConfig, MethodConfig
from plfl.seeding import ALA_SUBSET, LOCAL_TRAINING, derive_seed
from plfl.state import ClientStateStore, Params


@dataclass
class FederationContext:
    """What a method may use: the clients' data, their state store, the architecture and the options."""

    data: FederatedData
    store: ClientStateStore
    model: nn.Module  # the architecture (its own weights are not the global model)
    local_trainer: LocalTrainer  # the sequential executor's; methods train by yielding tasks
    federation: FederationConfig


def require_plain_steps(method: str, context: FederationContext, steps: str) -> None:
    """Refuse the options that a method whose own loop takes plain gradient ``steps`` would ignore:
    ``federation.momentum`` and ``data.augment`` (that loop neither keeps a momentum buffer nor crops
    and flips its batches).

    Raises:
        ConfigError: ``federation.momentum`` is not 0, or ``data.augment`` is true.
    """
    if context.federation.momentum != 0:
        raise ConfigError(f"{method} takes plain gradient steps in {steps} and has no use for federation.momentum "
                          f"(now {context.federation.momentum}); set federation.momentum=0.")
    if context.local_trainer.module.train_transform is not None:
        raise ConfigError(f"{method} trains {steps} in a loop of its own, which does not augment its batches; "
                          "data.augment=true would be ignored. Set data.augment=false.")


class Method:
    """Base class of FL methods; the defaults implement FedAvg's client side.

    Subclasses set ``name`` and override hooks; ``plfl.methods.METHODS`` registers them with
    their config schema (``self.config``).
    """

    name: ClassVar[str]
    # The attributes that make up the server's state between rounds (see :meth:`state_dict`).
    server_state: ClassVar[tuple[str, ...]] = ("global_params",)

    def __init__(self, config: MethodConfig, context: FederationContext, initial_params: Params):
        self.config = config
        self.context = context
        self.store = context.store
        self.global_params = initial_params
        self.ala = self.ala_config()
        if self.ala is not None:
            top_names(context.model, self.ala.p)  # refuses a p beyond the model's tensors before training

    def ala_config(self) -> Optional[ALAConfig]:
        return getattr(self.config, "ala", None)

    def server_message(self, client_id: int) -> Optional[Params]:
        """What the server sends client ``client_id`` this round (None: nothing is sent)."""
        return self.global_params

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Params | Trains[Params]:
        """The client's model after receiving ``message``: its model for evaluation and training.

        Default: overwrite the local model with the global one, or ALA's
        initialisation (run by the executor) when ALA is on and the client already has a local model.
        """
        local = self.store.get(client_id, "model")
        if self.ala is None or local is None:
            return {k: v.clone() for k, v in message.items()}
        return self.local_aggregation(client_id, message, local, round_)

    def local_aggregation(self, client_id: int, message: Params, local: Params, round_: int) -> Trains[Params]:
        """ALA's initialisation of the client's model from ``message`` and its old ``local`` model; keeps W_i."""
        outcome = yield LocalAggregationTask(client_id, message, local, self.store.get(client_id, "ala_weights"),
                                             derive_seed(self.seed, round_, client_id, ALA_SUBSET), self.ala)
        self.store.set(client_id, "ala_weights", outcome.weights)
        self.store.set(client_id, "ala_epochs", outcome.epochs)
        return outcome.params

    def local_train(self, client_id: int, params: Params, round_: int) -> Trains[TrainResult]:
        """Train the client from ``params`` for ``federation.local_epochs`` epochs."""
        return (yield self.train_task(client_id, params, round_, LOCAL_TRAINING,
                                      epochs=self.context.federation.local_epochs))

    def train_task(self, client_id: int, params: Params, round_: int, stream: int, **options: Any) -> TrainTask:
        """Training from ``params`` on the client's :meth:`training_samples`, its batch order drawn from
        (seed, round, client, ``stream``); ``options``: epochs or steps, and optionally trainable and
        proximal (see :class:`plfl.executors.TrainTask`). A hook yields it and receives its TrainResult."""
        return TrainTask(client_id, params, derive_seed(self.seed, round_, client_id, stream),
                         samples=self.training_samples(client_id), **options)

    def training_samples(self, client_id: int) -> Optional[torch.Tensor]:
        """Indices (int64, into the client's training split) that :meth:`train_task` trains on; None
        (default): all, unless a method holds part of the split out (FedFomo's validation split)."""
        return None

    def post_train(self, client_id: int, result: TrainResult, round_: int) -> TrainResult | Trains[TrainResult]:
        """Adjust the trained model before upload (e.g. FedFTHA's head fine-tuning)."""
        return result

    def client_message(self, client_id: int, result: TrainResult) -> Optional[Params]:
        """What the client uploads after training (None: nothing is sent): ``result.upload`` if the
        method set one, else the trained model."""
        return result.params if result.upload is None else result.upload

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """Update the server state (``self.global_params``) from the clients' messages."""
        raise NotImplementedError

    def global_model(self) -> Optional[Params]:
        """The server's model to evaluate on the union of all clients' test splits
        (logged as ``global_accuracy``); None (default): no global evaluation."""
        return None

    def round_tables(self, round_: int) -> dict[str, list[dict[str, Any]]]:
        """Per-round tables too large for one metrics row (e.g. per-client statistics,
        aggregation-weight matrices): name → rows; written to ``tables/<name>.csv``."""
        return {}

    def round_metrics(self) -> dict[str, float]:
        """Method statistics logged with each round's metrics.

        ALA: mean, std, and fractions at 0 (local value kept) and 1 (global value
        taken) of all clients' element-wise weights W_i, and mean epochs of the last ALA.
        """
        if self.ala is None:
            return {}
        weights = [w for i in range(len(self.store)) if (w := self.store.get(i, "ala_weights"))]
        epochs = [e for i in range(len(self.store)) if (e := self.store.get(i, "ala_epochs"))]
        if not weights:
            return {}
        flat = torch.cat([t.flatten() for w in weights for t in w.values()])
        return {"ala_weight_mean": flat.mean().item(), "ala_weight_std": flat.std(correction=0).item(),
                "ala_weight_zero_fraction": (flat == 0).float().mean().item(),
                "ala_weight_one_fraction": (flat == 1).float().mean().item(),
                "ala_epochs_mean": sum(epochs) / len(epochs)}

    def state_dict(self) -> dict[str, Any]:
        """The server's state between rounds, for checkpoints: the ``server_state`` attributes
        (tensors, numbers, and dicts and lists of them). Per-client state is in the store."""
        return {name: getattr(self, name) for name in self.server_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        for name in self.server_state:
            setattr(self, name, state[name])

    @property
    def seed(self) -> int:
        return self.context.federation.seed


def numel(message: Optional[Params]) -> int:
    """Number of scalars in a message (0 for None)."""
    return 0 if message is None else sum(t.numel() for t in message.values())


def nbytes(message: Optional[Params]) -> int:
    """Size of a message's tensors in bytes (0 for None)."""
    return 0 if message is None else sum(t.numel() * t.element_size() for t in message.values())
