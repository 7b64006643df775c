"""The Method interface: the hooks a federation loop calls each round, and what a method may use.

A round r, as :class:`plfl.federation.FederationLoop` runs it:

1. every sampled client: ``local_train`` (from its model and the message it received at the
   broadcast of round r − 1) → ``post_train`` → ``client_message``;
2. the server: ``aggregate`` of the received messages;
3. every client: ``server_message`` → ``pre_local_init`` (its model for the next round's training
   and for this round's evaluation); ``round_metrics`` and ``round_tables`` close the round.

Every hook takes the round as its last argument. A method overrides only the hooks its algorithm
changes. Hooks that need client work (``pre_local_init``, ``local_train``, ``post_train``) are
generator functions that yield tasks of :mod:`plfl.tasks` (:meth:`Method.train_task`,
:meth:`Method.step_task`, evaluation) and receive their results; the loop runs the tasks through its
executor, every client's together. A plain function's value is used as it is. A hook that extends
its parent's writes ``result = yield from super().local_train(...)``. The default hooks are FedAvg's
client side. A hook that adds a step to any method's is a mixin placed before the method's class, as ALA
(:class:`plfl.methods.ala.AdaptiveLocalAggregation`) adds its local aggregation to ``pre_local_init``.

A method is one module: its config dataclass (a :class:`MethodConfig`, one commented field per
hyperparameter) beside its class, which names it once (``name``) and points at the config
(``config_class``); :mod:`plfl.methods` finds it there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

import torch
from torch import nn

from plfl.errors import ConfigError, FederationError
from plfl.fields import documented
from plfl.plots import Plot
from plfl.privacy import ClientLevelDP, SampleLevelDP
from plfl.robust import robust_average
from plfl.sections import AggregationConfig
from plfl.seeding import clients_per_round, derive_seed
from plfl.state import ClientStateStore, Params
from plfl.tasks import Forward, Step, StepTask, TrainResult, TrainTask, Work

if TYPE_CHECKING:
    from plfl.data.federated import FederatedData
    from plfl.sections import FederationConfig


@dataclass
class MethodConfig:
    """Keys every method accepts (``method.*``)."""

    name: str = documented("fedavg", "the method (plfl methods lists them); its own keys sit beside it")


@dataclass
class FederationContext:
    """What a method may use: the clients' data, their state store, the run's ``federation.*`` options, the
    architecture, whether the executors augment training batches (``data.augment``) and the rule that
    :meth:`Method.average` follows (``aggregation.*``, or client-level DP with ``privacy.level=client``)."""

    data: FederatedData
    store: ClientStateStore
    federation: FederationConfig
    architecture: nn.Module  # the clients' model: its structure; its weights are not the global model
    augment: bool = False
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    privacy: Optional[ClientLevelDP] = None  # privacy.level=client: the server's DP mean, its clip norm and ε
    dp_sgd: Optional[SampleLevelDP] = None  # privacy.level=sample: each client's ε, one step per local step


def require_private_steps(method: str, context: FederationContext, work: str) -> None:
    """Refuse sample-level DP (``privacy.level=sample``) for a method whose client ``work`` reads the client's
    samples outside the plain training loop (its own steps, or losses it chooses by): DP-SGD runs in that loop
    only, and this work would read them unprivatised.

    Raises:
        ConfigError: ``privacy.level`` is sample.
    """
    if context.dp_sgd is not None:
        raise ConfigError(
            f"privacy.level=sample runs DP-SGD in the plain local training only, but {method} {work}, which would "
            "read the client's samples without clipping and noise. Set "
            "privacy.level=none (or client), or choose a method that trains only in the plain loop (fedavg, ditto, "
            "fedprox, fedper, fedrep and the other methods built on local training)."
        )


def require_plain_steps(method: str, context: FederationContext, steps: str) -> None:
    """Refuse the options that a method whose own steps take plain gradient ``steps`` would ignore:
    ``federation.momentum`` and ``data.augment`` (its steps neither keep a momentum buffer nor crop and flip
    their batches).

    Raises:
        ConfigError: ``federation.momentum`` is not 0, ``data.augment`` is true, or ``privacy.level`` is sample
            (:func:`require_private_steps`).
    """
    require_private_steps(method, context, f"trains {steps} in steps of its own")
    if context.federation.momentum != 0:
        raise ConfigError(
            f"{method} takes plain gradient steps in {steps} and has no use for federation.momentum "
            f"(now {context.federation.momentum}); set federation.momentum=0."
        )
    if context.augment:
        raise ConfigError(
            f"{method} trains {steps} in steps of its own, which do not augment their batches; "
            "data.augment=true would be ignored. Set data.augment=false."
        )


def require_linear_head(method: str, context: FederationContext, why: str) -> nn.Linear:
    """The architecture's head, for a method that needs a body and one linear head (``why``: what it does with it).

    Raises:
        ConfigError: the model is not a body and a head, or its head is not one ``nn.Linear`` layer.
    """
    architecture = context.architecture
    head = getattr(architecture, "head", None)
    if not isinstance(head, nn.Linear) or not hasattr(architecture, "body"):
        raise ConfigError(
            f"{method} {why}, so the model's head must be one nn.Linear layer; {type(architecture).__name__} has "
            f"{type(head).__name__} as its head. Choose a model of plfl.models."
        )
    return head


class Method:
    """Base class of FL methods; the defaults implement FedAvg's client side.

    Subclasses set ``name`` (``method.name``) and ``config_class`` (their ``method.*`` keys) and override
    hooks; the class docstring's first line is the method's summary (``plfl methods``).
    """

    name: ClassVar[str]
    config_class: ClassVar[type[MethodConfig]] = MethodConfig
    # The attributes that make up the server's state between rounds (see :meth:`state_dict`).
    server_state: ClassVar[tuple[str, ...]] = ("global_params",)
    # Config overrides (dotted keys) under which the test suite runs this method on every executor (3 rounds on
    # 5 digits clients), so that its own code paths run, e.g. past a warm-up; a class's own, never inherited.
    matrix_options: ClassVar[dict[str, Any]] = {}
    # What plfl report draws of this method's round_metrics and round_tables, beside every run's figures.
    figures: ClassVar[tuple[Plot, ...]] = ()
    # Why ``aggregate`` does not average client models through :meth:`average`, said when ``aggregation.rule`` is
    # not mean or ``privacy.level`` is client; None: it does, and takes every rule and client-level DP.
    not_averaging: ClassVar[Optional[str]] = "its aggregate does not average client models"
    # Whether the upload is a model (or part of one) beside the received one, which model attacks
    # (attack.kind: sign_flip, scale, gaussian) can change; False: it holds other tensors (prototypes, control
    # variates, Fisher traces) or nothing, and model attacks are refused before the run starts.
    uploads_model: ClassVar[bool] = True

    @classmethod
    def client_network(cls, model: nn.Module) -> nn.Module:
        """The clients' architecture built around ``model`` (``model.name``'s network), before the initial model
        is drawn from it: ``model`` itself (default), or a network that adds the method's own modules, as GPFL adds
        its conditional valve and class embeddings (:func:`plfl.models.networks.valved`)."""
        return model

    def __init__(self, config: MethodConfig, context: FederationContext, initial_params: Params):
        self.config = config
        self.context = context
        self.store = context.store
        self.global_params = initial_params
        check_aggregation(self.name, self.not_averaging, context)

    def average(self, states: list[Params], weights: list[float], sent: Params, round_: int) -> Params:
        """The clients' models ``states`` combined by ``aggregation.rule`` (:func:`plfl.robust.robust_average`):
        the weighted mean Σ_i w_i θ_i / Σ_i w_i by default. ``weights``: one per state (e.g. training samples);
        ``sent``: the model the clients started from (the same keys), the reference of norm bounding's updates.
        With ``privacy.level=client``, DP-FedAvg's clipped, unweighted and noised mean of the updates from ``sent``
        instead (:meth:`plfl.privacy.ClientLevelDP.aggregate`, its noise drawn from the seed and ``round_``).

        Raises:
            FederationError: a round left with too few models for the rule (Krum's n > 2f + 2, after failures or
                dropouts); the message names the fix.
        """
        try:
            if self.context.privacy is not None:
                return self.context.privacy.aggregate(states, sent, round_)
            return robust_average(states, weights, sent, self.context.aggregation)
        except ValueError as error:  # the run's finished rounds stay on disk; the loop stops with the reason
            rule = (
                "privacy.level=client" if self.context.privacy else f"aggregation.rule={self.context.aggregation.rule}"
            )
            raise FederationError(f"{rule}: {error}") from error

    def server_message(self, client_id: int, round_: int) -> Optional[Params]:
        """What the server sends client ``client_id`` at the broadcast of ``round_`` (None: nothing is sent);
        called once per client and round, after ``aggregate``."""
        return self.global_params

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Params | Work[Params]:
        """The client's model after receiving ``message``: its model for evaluation and training.

        Default: the received model, replacing the client's own (its tensors are not copied: the store's values,
        the server's and the messages are never modified in place). Methods that keep a model of their own start
        from :meth:`own_model` or :meth:`received_over_own`.
        """
        return dict(message)

    def own_model(self, client_id: int, first: Params) -> Params:
        """The client's own model from the store; before its first training, a copy of ``first`` (the received
        model, or the initial global model)."""
        return self.store.get(client_id, "model") or {k: v.clone() for k, v in first.items()}

    def received_over_own(self, client_id: int, message: Params, first: Params) -> Params:
        """The received tensors (a part of the model) over the client's own model; before its first training,
        over ``first``: a model whose other tensors never leave the client (local layers, a personal head)."""
        own = self.store.get(client_id, "model") or first
        return {**own, **{k: v.clone() for k, v in message.items()}}

    def local_train(
        self, client_id: int, params: Params, message: Optional[Params], round_: int
    ) -> TrainResult | Work[TrainResult]:
        """Train the client from ``params`` (its model) for ``federation.local_epochs`` epochs or
        ``federation.local_steps`` steps; ``message``: what it received at the last broadcast."""
        return (
            yield self.train_task(client_id, params, round_, "local_training", **self.context.federation.local_length())
        )

    def local_lengths(self) -> list[dict[str, float]]:
        """The local trainings of a sampled client in one round, each as :class:`plfl.tasks.TrainTask` keywords
        (epochs or steps): FedAvg's one, ``federation.local_epochs`` or ``federation.local_steps``. The σ of
        ``privacy.target_epsilon`` is computed for them; a method that trains a client more than once a round
        names each training, and private steps of its own on a fraction of the samples add ``share``
        (:func:`plfl.privacy.local_steps`)."""
        return [self.context.federation.local_length()]

    def private_steps(self, steps: Callable[[dict[str, float]], int], rounds: int) -> int:
        """The most local steps one client takes in a run of ``rounds`` rounds when it is sampled in every round,
        ``steps`` counting one training's steps on the client's samples from its :class:`plfl.tasks.TrainTask`
        keywords; ``privacy.target_epsilon``'s σ is computed for it. By default ``rounds`` × the
        :meth:`local_lengths`; a method whose trainings vary from round to round (Self-FL) or that trains once
        more in the last round (FedBABU) adds them."""
        return rounds * sum(map(steps, self.local_lengths()))

    def train_task(self, client_id: int, params: Params, round_: int, stream: str, **options: Any) -> TrainTask:
        """Training from ``params`` on the client's :meth:`training_samples`, its batch order drawn from
        (seed, round, client, the random stream named ``stream``, :func:`plfl.seeding.derive_seed`); ``options``:
        epochs or steps, and optionally trainable, proximal and samples, other ones than
        :meth:`training_samples` (see :class:`plfl.tasks.TrainTask`). A hook yields it and receives its
        TrainResult."""
        options = {"samples": self.training_samples(client_id), **options}
        if self.context.dp_sgd is not None:
            samples = options["samples"]
            n = self.context.data.clients[client_id].num_train if samples is None else len(samples)
            self.context.dp_sgd.account(client_id, n, options.get("epochs"), options.get("steps"))
        return TrainTask(client_id, params, derive_seed(self.seed, round_, client_id, stream), **options)

    def step_task(
        self, client_id: int, step: Step, state: Params, round_: int, stream: str, **options: Any
    ) -> StepTask:
        """``step`` on the client's training batches from ``state``, their order drawn from (seed, round, client,
        the stream named ``stream``), in batches of ``federation.batch_size`` for ``federation.local_epochs``
        epochs or ``federation.local_steps`` steps unless ``options`` say otherwise (see
        :class:`plfl.tasks.StepTask`); with ``federation.drop_last`` only full batches. A hook yields it and
        receives its StepResult.

        Raises:
            ConfigError: ``privacy.level=sample`` (:func:`require_private_steps`; a method that takes steps of its
                own refuses it when it is built).
        """
        require_private_steps(self.name, self.context, f"takes {stream} steps of its own")
        federation = self.context.federation
        options = {"batch_size": federation.batch_size, **options}
        if federation.drop_last:
            options["min_last_batch"] = options["batch_size"]
        if "steps" not in options and "epochs" not in options:
            options.update(federation.local_length())
        return StepTask(client_id, step, state, derive_seed(self.seed, round_, client_id, stream), **options)

    def training_samples(self, client_id: int) -> Optional[torch.Tensor]:
        """Indices (int64, into the client's training split) that :meth:`train_task` trains on; None
        (default): all, unless a method holds part of the split out (FedFomo's validation split)."""
        return None

    def post_train(self, client_id: int, result: TrainResult, round_: int) -> TrainResult | Work[TrainResult]:
        """Adjust the trained model before upload (e.g. FedFTHA's head fine-tuning)."""
        return result

    def client_message(self, client_id: int, result: TrainResult, round_: int) -> Optional[Params]:
        """What the client uploads after training (None: nothing is sent): ``result.upload`` if the
        method set one, else the trained model."""
        return result.params if result.upload is None else result.upload

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """Update the server state (``self.global_params``) from the clients' messages."""
        raise NotImplementedError

    def prediction(self) -> Optional[Forward]:
        """How the clients' models predict when it is not the architecture's forward pass: a
        :class:`plfl.tasks.Forward` that evaluates every client's model (FedCP's two heads on a per-sample split of
        the features); None (default): the architecture's. The global and new clients' models are evaluated by
        the architecture's forward pass either way."""
        return None

    def global_model(self, round_: int) -> Optional[Params]:
        """The server's model to evaluate on each participating client's test split (pooled, logged as
        ``global_accuracy``); None (default): no global evaluation."""
        return None

    def new_client_model(self, round_: int) -> Optional[Params]:
        """The model a client that has never taken part receives after ``round_``'s aggregation, as a newly
        joining client would: what the federation evaluates its unseen clients on (``federation.unseen_clients``,
        after ``eval.finetune_epochs`` of fine-tuning on the client's own training split). It must not change
        the method's state. Default: the global model (:meth:`global_model`); None: the method has no model for a
        new client, and a run with unseen clients is refused.
        """
        return self.global_model(round_)

    def round_tables(self, round_: int) -> dict[str, list[dict[str, Any]]]:
        """Per-round tables too large for one metrics row (e.g. per-client statistics,
        aggregation-weight matrices): name → rows; written to ``tables/<name>.csv``."""
        return {}

    def round_metrics(self, round_: int) -> dict[str, float]:
        """Method statistics logged with each round's metrics (default: none)."""
        return {}

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


def check_aggregation(method: str, not_averaging: Optional[str], context: FederationContext) -> None:
    """Refuse an ``aggregation.rule`` or client-level DP that ``method`` cannot follow (``not_averaging``: why its
    aggregate does not average client models), or a rule that a round's sampled clients are too few for.

    Raises:
        ConfigError: naming the method, the reason and the fix.
    """
    if context.privacy is not None and not_averaging is not None:
        raise ConfigError(
            f"privacy.level=client clips and noises the mean of the client models' updates, but {method} "
            f"{not_averaging}. Set privacy.level=none, or choose a method that averages client models (fedavg and "
            "the methods built on it)."
        )
    rule = context.aggregation
    if rule.rule == "mean":
        return
    if not_averaging is not None:
        raise ConfigError(
            f"aggregation.rule={rule.rule} replaces the mean of client models, but {method} {not_averaging}. "
            "Set aggregation.rule=mean, or choose a method that averages client models (fedavg and the methods "
            "built on it)."
        )
    sampled = clients_per_round(len(context.data.clients), context.federation.join_ratio)
    least = {"krum": 2 * rule.byzantine + 3, "multi_krum": max(2 * rule.byzantine + 3, rule.selected)}.get(rule.rule, 1)
    if sampled < least:
        raise ConfigError(
            f"aggregation.rule={rule.rule} with aggregation.byzantine={rule.byzantine}"
            + (f" and aggregation.selected={rule.selected}" if rule.rule == "multi_krum" else "")
            + f" needs at least {least} clients per round (Krum's n > 2f + 2), but a round samples {sampled}. "
            "Lower aggregation.byzantine (or aggregation.selected), or raise federation.join_ratio."
        )


def numel(message: Optional[Params]) -> int:
    """Number of scalars in a message (0 for None)."""
    return 0 if message is None else sum(t.numel() for t in message.values())


def nbytes(message: Optional[Params]) -> int:
    """Size of a message's tensors in bytes (0 for None)."""
    return 0 if message is None else sum(t.numel() * t.element_size() for t in message.values())
