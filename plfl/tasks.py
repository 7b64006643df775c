"""Client work as data: the tasks a method's hooks hand to an executor, and what comes back.

Methods build tasks and read results; executors run tasks and build results. Both import this
module, never each other. A task names its client by id (the executor holds the federation's data)
and carries everything else by value, so that any executor (in-process, vectorized, on a remote
worker) runs it the same way. Four kinds:

- :class:`TrainTask`: local training of the model with SGD on the cross-entropy (Lightning's loop on
  the sequential executor), optionally with a proximal term or part of the parameters frozen;
- :class:`StepTask`: a method's own update, one :class:`Step` per mini-batch of the one batch order
  (:mod:`plfl.batches`) or of given samples in a given order: ALA's weight learning, pFedMe's bi-level
  steps, APPLE's mixture, ...;
- :class:`FeatureTask`: the outputs of a submodule (the body's features) on some of a client's training
  samples, e.g. for a step that trains the head on fixed features (ALA) or for class prototypes;
- :class:`EvalTask`: accuracy and loss of a model on a client's test or validation split, or on part
  of its training split; by the architecture's forward pass, or by a method's :class:`Forward` where a
  client's prediction is not the architecture's own (FedCP's policy-split heads).

A hook that needs client work is a generator: ``result = yield task`` (or ``results = yield [task,
...]``) hands tasks to the loop and receives their results (:data:`Work`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Generator, NamedTuple, Optional, Protocol, TypeVar, Union

import torch
from torch import nn

from plfl.state import Params

T = TypeVar("T")


def proximal_penalty(params: Params, anchor: Params, mu: float) -> torch.Tensor:
    """μ/2 · Σ_k ‖params[k] − anchor[k]‖² over the keys of ``params``: a 0-dim tensor.

    FedProx's proximal term (Li et al., MLSys 2020, Eq. 2) with ``anchor`` the received global
    model; Ditto's personal objective (Li et al., ICML 2021, Eq. 2) with μ = λ. Its gradient
    adds μ(θ − anchor) to the cross-entropy's. Lightning's training loop and the vectorized
    executor's step both add this term.
    """
    return mu / 2 * torch.stack([(p - anchor[k]).pow(2).sum() for k, p in params.items()]).sum()


@dataclass(frozen=True)
class ProximalTerm:
    """:func:`proximal_penalty` of the trainable parameters at ``anchor``, added to the local loss."""

    anchor: Params  # state_dict names → tensors; only the model's parameters are used
    mu: float  # μ ≥ 0

    def penalty(self, model: nn.Module) -> torch.Tensor:
        """The scalar term for ``model``'s current parameters (frozen parameters count 0)."""
        trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
        return proximal_penalty(trainable, self.anchor, self.mu)

    def to(self, device: torch.device) -> ProximalTerm:
        return ProximalTerm({k: v.to(device) for k, v in self.anchor.items()}, self.mu)


@dataclass(frozen=True, eq=False)
class TrainTask:
    """Local training of client ``client_id`` on its training split: SGD at ``federation.lr`` and
    ``federation.momentum`` on the batch-mean cross-entropy, batches of ``federation.batch_size``.

    Raises:
        ValueError: not exactly one of ``epochs`` and ``steps``, or one below 1.
    """

    client_id: int
    params: Params  # the starting state (not modified)
    seed: int  # batch order and augmentation draws (derive_seed of run, round, client, stream)
    epochs: Optional[int] = None
    steps: Optional[int] = None
    trainable: Optional[frozenset[str]] = None  # parameter names to update (None: all); any set is frozen
    proximal: Optional[ProximalTerm] = None  # μ/2 ‖θ − anchor‖² added to the loss (FedProx, Ditto)
    samples: Optional[torch.Tensor] = None  # (n,) int64 indices into the training split; None: all of it

    def __post_init__(self) -> None:
        _check_length(self, self.epochs, self.steps)
        if self.trainable is not None:
            object.__setattr__(self, "trainable", frozenset(self.trainable))


class Batch(NamedTuple):
    """One mini-batch as a step sees it: x ``(W, *input_shape)``, y (W,) int64, and mask (W,) float 1/0 marking
    the real samples of a padded batch (the vectorized executor's) or None when all W are real; for a task with
    ``noise_std`` (:class:`StepTask`), ``noise``: this step's DP-SGD noise, a tensor of each state tensor's shape,
    else None."""

    x: torch.Tensor
    y: torch.Tensor
    mask: Optional[torch.Tensor]
    noise: Optional[Params] = None


class Network(Protocol):
    """The clients' architecture as a function of its state, given to a :class:`Step` by the executor."""

    def __call__(
        self, state: Params, x: torch.Tensor, mask: Optional[torch.Tensor] = None, module: str = ""
    ) -> tuple[torch.Tensor, Params]:
        """Run submodule ``module`` ("": the whole model; "body", "head") in training mode on ``x`` (W, ...),
        its tensors taken from ``state`` (state_dict names of the whole model, e.g. ``head.weight``; every
        tensor of the submodule must be there). Returns its output (W, ...) and its buffers after the pass:
        BatchNorm's running statistics updated by the batch statistics of the samples where ``mask`` is 1,
        as new tensors (``state``'s are not modified)."""


class StepOutput(NamedTuple):
    """What a :class:`Step` returns: the new state, the step's loss (a 0-dim tensor: a mean over
    ``samples`` samples), and ``samples`` (an int, or a 0-dim tensor under the vectorized executor)."""

    state: Params
    loss: torch.Tensor
    samples: Union[int, torch.Tensor]


class Step:
    """A method's update on one mini-batch, a pure function of tensors.

    ``__call__(network, state, inputs, shared, batch)`` returns the new ``state`` from the old one
    (tensors in, new tensors out, nothing modified in place), using only torch operations that
    ``torch.func`` transforms: the vectorized executor runs it under ``vmap`` over a cohort of clients,
    the sequential and Ray executors call it for one client (``batch.mask`` None). Padding must not
    count: a loss over a batch is a mean over the samples where ``batch.mask`` is 1 (:func:`masked_mean`).
    Gradients come from ``torch.func.grad`` inside the step.

    Subclasses are frozen dataclasses of their hyperparameters (equal steps train in one cohort) defined at
    a module's top level (the Ray executor ships them by reference); ``work`` names them in a failed
    client's reason.
    """

    work: ClassVar[str] = "a method's step"

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        raise NotImplementedError


def prefixed(params: Params, part: str) -> Params:
    """``params`` under the names ``<part>/<name>``: one model's entries in a step's state that carries
    several models (e.g. APFL's w and v)."""
    return {f"{part}/{k}": v for k, v in params.items()}


@dataclass(frozen=True, eq=False)
class StepTask:
    """Client ``client_id`` runs ``step`` on its training batches: ``state`` through every batch in turn.

    The batches are the one batch order of ``batch_size`` (:func:`plfl.batches.training_rows`, drawn from
    ``seed``) for ``epochs`` epochs or ``steps`` batches, or, with ``ordered_samples``, those training samples
    in their order, cut into the same batches every epoch; with ``data``, of those samples instead. A last batch
    shorter than ``min_last_batch`` samples, or than the model needs (two with BatchNorm), is left out
    (:func:`plfl.batches.epoch_size`). With ``noise_std`` > 0 (DP-SGD's σC, for a step that privatises its
    gradient), every batch comes with a draw N(0, noise_std²) per scalar of each state tensor (``Batch.noise``),
    from the generator :func:`plfl.privacy.noise_generator` of ``seed``, tensor after tensor in the state's
    order: the same draws on every executor.

    Raises:
        ValueError: not exactly one of ``epochs`` and ``steps``, one below 1, ``ordered_samples`` with
            ``steps``, or ``min_last_batch`` below 1.
    """

    client_id: int
    step: Step
    state: Params  # carried from batch to batch (not modified)
    seed: int
    batch_size: int
    epochs: Optional[int] = None
    steps: Optional[int] = None
    inputs: Params = field(default_factory=dict)  # the client's own fixed tensors
    # Fixed tensors common to many clients: tasks that hold the very same tensors share one copy in the
    # vectorized executor (the round's global model, all clients' core models).
    shared: Params = field(default_factory=dict)
    ordered_samples: Optional[torch.Tensor] = None  # (m,) int64 indices into the training split, batched in order
    min_last_batch: int = 1  # e.g. a step that splits its batch into parts needs a sample in each
    # The samples by value, x (n, ...) and y (n,) int64, in place of the client's training split (e.g. a
    # FeatureTask's features); the batches and ordered_samples index into them.
    data: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    noise_std: float = 0.0

    def __post_init__(self) -> None:
        _check_length(self, self.epochs, self.steps)
        if self.steps is not None and self.ordered_samples is not None:
            raise ValueError("a StepTask with ordered samples counts epochs, not steps")
        if self.min_last_batch < 1:
            raise ValueError(f"a StepTask's min_last_batch must be >= 1; got {self.min_last_batch}")


def shared_identity(task: StepTask) -> tuple:
    """What identifies a step task's ``shared`` tensors: their names and the tensor objects. Tasks with equal
    identities hold the very same tensors, which an executor keeps or sends once."""
    return tuple((name, id(tensor)) for name, tensor in task.shared.items())


@dataclass(frozen=True, eq=False)
class FeatureTask:
    """The outputs of submodule ``module`` ("body": the features the head reads) of the model with ``params`` on
    client ``client_id``'s training samples ``samples``, without gradients, in the batches of ``batch_size`` that
    a :class:`StepTask` with these ordered samples runs on, in training mode like a step's network (BatchNorm
    normalises each batch by its own statistics); a last batch too short for the model is left out likewise."""

    client_id: int
    params: Params  # state_dict names → tensors; those of ``module`` are used
    samples: torch.Tensor  # (m,) int64 indices into the client's training split, in the order to batch them
    batch_size: int
    module: str = "body"


class Forward:
    """A method's prediction from a client's model where it is not the architecture's forward pass, a pure
    function of tensors evaluated without gradients (FedCP's: two heads on a per-sample split of the features).

    ``__call__(network, params, x, rows)`` returns the logits (W, classes) of the W samples x ``(W, *input_shape)``
    from the model's tensors ``params`` (the architecture's state_dict names and the method's own), ``rows`` (W,)
    int64 the samples' indices in the evaluated split (keys for draws that must not depend on how the executor
    batches the samples). ``network`` runs the architecture's submodules in evaluation mode (BatchNorm's running
    statistics). Like a :class:`Step`, only ``torch.func``-transformable operations (the vectorized executor runs
    it under ``vmap`` over a cohort, padded rows included, whose logits do not count); subclasses are frozen
    dataclasses defined at a module's top level.
    """

    work: ClassVar[str] = "a method's prediction"

    def __call__(self, network: Network, params: Params, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class EvalTask:
    """Evaluation of ``params`` on client ``client_id``'s test split, with ``split="val"`` on its validation
    split (``data.val_fraction``), or with ``samples`` on those samples of its training split (a method's own
    hold-out, e.g. FedFomo's); with ``forward``, its logits are the method's :class:`Forward` of ``params``.

    Raises:
        ValueError: ``split`` is neither "test" nor "val", or "val" with ``samples``.
    """

    client_id: int
    params: Params
    samples: Optional[torch.Tensor] = None  # (m,) int64 indices into the client's training split
    split: str = "test"  # without samples: "test" or "val", the client's split evaluated
    forward: Optional[Forward] = None  # the method's prediction; None: the architecture's forward pass

    def __post_init__(self) -> None:
        if self.split not in ("test", "val"):
            raise ValueError(f'an EvalTask evaluates split "test" or "val"; got {self.split!r}')
        if self.split == "val" and self.samples is not None:
            raise ValueError("an EvalTask of the validation split names no samples")


Task = Union[TrainTask, StepTask, FeatureTask, EvalTask]


@dataclass
class TrainResult:
    """Outcome of one client's local training."""

    params: Params  # trained state (CPU tensors): the client's model from now on
    loss: float  # sample-weighted mean cross-entropy over the steps taken (no proximal term)
    samples_seen: int  # training samples processed (epochs × n, or steps × batch; see plfl.batches on BatchNorm)
    # What the client uploads when it is not ``params``, e.g. Ditto's trained copy of the global
    # model beside its personal model (Method.client_message).
    upload: Optional[Params] = None


@dataclass
class StepResult:
    """Outcome of a :class:`StepTask`: the final state (CPU tensors), the steps' losses averaged with their
    ``samples`` as weights, the training samples of all batches, and each epoch's last batch loss."""

    state: Params
    loss: float
    samples_seen: int
    epoch_losses: list[float]


@dataclass
class FeatureResult:
    """A :class:`FeatureTask`'s outputs x (m', ...) and the samples' labels y (m',) int64, CPU tensors, in the
    samples' order: m' = m unless a last batch was left out (x is empty when none is left).
    ``StepTask(data=(x, y))`` steps on them."""

    x: torch.Tensor
    y: torch.Tensor


@dataclass
class EvalResult:
    """A model on one evaluated split: ``correct`` of ``total`` samples, mean cross-entropy ``loss``."""

    correct: int
    total: int
    loss: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")


@dataclass(frozen=True)
class ClientFailure:
    """Why a client's work failed (an exception, or NaN/Inf in its trained parameters); the loop leaves the
    client out of its round."""

    reason: str


# A hook that needs client work: it yields a task (or a list of tasks), receives its result (their
# results, in order), and returns its own value.
Work = Generator[Union[Task, list[Task]], object, T]


def resolved(value: Work[T] | T) -> Work[T]:
    """A hook's return value as a generator: a working hook's own, or one that returns a plain hook's value
    (so that ``yield from resolved(hook(...))`` runs either)."""
    if isinstance(value, Generator):
        return (yield from value)
    return value


def masked_mean(values: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The mean of (W,) ``values`` over the real samples (mask 1), or over all W when ``mask`` is None."""
    return values.mean() if mask is None else (values * mask).sum() / mask.sum()


def masked_cross_entropy(logits: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The batch-mean cross-entropy of logits (W, classes) for labels y (W,) over the real samples."""
    if mask is None:
        return torch.nn.functional.cross_entropy(logits, y)
    return masked_mean(torch.nn.functional.cross_entropy(logits, y, reduction="none"), mask)


def sample_count(batch: Batch) -> Union[int, torch.Tensor]:
    """How many real samples ``batch`` holds."""
    return len(batch.y) if batch.mask is None else batch.mask.sum()


def raised(error: Exception, work: str = "local training") -> ClientFailure:
    """The failure of a client whose ``work`` raised ``error``."""
    return ClientFailure(f"{work} raised {type(error).__name__}: {error}")


def finite_or_failure(result: T, params: Optional[Params] = None) -> T | ClientFailure:
    """``result``, or a failure when its parameters (``params``, default ``result.params``) hold NaN or Inf."""
    bad = non_finite(result.params if params is None else params)
    if bad is None:
        return result
    return ClientFailure(f"its trained parameter {bad!r} holds NaN or Inf (training diverged)")


def non_finite(params: Optional[Params]) -> Optional[str]:
    """The name of the first floating tensor in ``params`` that holds NaN or Inf; None if there is none."""
    for name, tensor in (params or {}).items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            return name
    return None


def _check_length(task: object, epochs: Optional[int], steps: Optional[int]) -> None:
    if (epochs is None) == (steps is None) or (epochs or steps) < 1:
        raise ValueError(
            f"a {type(task).__name__} takes exactly one of epochs and steps, >= 1; got epochs={epochs}, steps={steps}"
        )
