"""pFedMe (Dinh, Tran and Nguyen, NeurIPS 2020, arXiv:2006.08848): personalized models from Moreau envelopes.

Client i's objective is the Moreau envelope F_i(w) = min_θ f_i(θ) + λ/2 ‖θ − w‖² of its loss f_i;
the minimiser θ̂_i(w) is its personalized model. Alg. 1, per round, a sampled client
starts its local w and θ from the received global Θ and, per mini-batch D of
``federation.local_epochs`` epochs (``local_train``, the step task :class:`PFedMeStep`):

- θ ≈ argmin_θ f_i(θ; D) + λ/2 ‖θ − w‖² by K gradient steps
  θ ← θ − lr_p (∇f_i(θ; D) + λ (θ − w)) (``inner_solution``; K = ``method.k``,
  lr_p = ``method.personal_lr``), warm-started from the previous batch's θ;
- w ← w − η λ (w − θ) (``local_update``; η = ``federation.lr``); w is uploaded.

Server (``aggregate``): Θ ← (1 − β) Θ + β Θ̄, Θ̄ the uploads' mean (``beta_mix``; β = ``method.beta``).
The client keeps and evaluates its last θ (``pre_local_init``); the global Θ is evaluated on all
clients' test data. Batches come from the one batch order of every method's local training
(stream "local_training"); the steps are functional (torch.func) plain gradient steps, so
``federation.momentum`` must be 0. The reported loss is f_i(θ; D) averaged over all
inner steps; BatchNorm statistics, if any, follow the inner steps and go with both θ and w.
Departures: Θ̄ is the sample-weighted mean, as PFLlib computes it (Alg. 1: the
plain mean); PFLlib's inner step adds a weight decay 0.001·θ that the paper lacks, left out here;
PFLlib's per-client evaluation ends up evaluating the received global model (its θ and the
model share tensors), while plfl evaluates θ, as the paper does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.func import grad_and_value

from plfl.fields import checked
from plfl.methods.base import FederationContext, MethodConfig, require_plain_steps
from plfl.methods.fedavg import FedAvg
from plfl.state import Params
from plfl.tasks import (
    Batch,
    Network,
    Step,
    StepOutput,
    StepResult,
    TrainResult,
    Work,
    masked_cross_entropy,
    prefixed,
    sample_count,
)

# (θ, buffers) → (∇_θ f(θ; D), f(θ; D), the buffers after the forward pass) on one mini-batch D.
GradFn = Callable[[Params, Params], tuple[Params, torch.Tensor, Params]]


@dataclass
class PFedMeConfig(MethodConfig):
    """pFedMe's keys (Dinh et al., NeurIPS 2020, Alg. 1); η of the local update is ``federation.lr``.
    The kept personalized model is pFedMe's local initialisation, so there is no ``method.ala``."""

    lam: float = checked(
        1.0, lambda v: v > 0, "a number > 0", "λ: weight of λ/2‖θ − w‖² in the Moreau envelope (PFLlib's lamda, 1.0)"
    )
    k: int = checked(
        5, lambda v: v >= 1, "an integer >= 1", "K: gradient steps on each mini-batch's inner problem (PFLlib's K, 5)"
    )
    personal_lr: float = checked(
        0.01, lambda v: v > 0, "a number > 0", "step size of the K inner steps (PFLlib's p_learning_rate, 0.01)"
    )
    beta: float = checked(
        1.0,
        lambda v: v > 0,
        "a number > 0",
        "β: the server moves Θ ← (1 − β) Θ + β · mean of the uploads; 1 = FedAvg's average "
        "(PFLlib's shared -bt default 0 would never move Θ)",
    )


def inner_solution(
    grad_fn: GradFn, theta: Params, w: Params, buffers: Params, lam: float, lr: float, steps: int
) -> tuple[Params, torch.Tensor, Params]:
    """``steps`` (K) gradient steps θ ← θ − lr (∇f(θ) + λ (θ − w)) on f(θ) + λ/2 ‖θ − w‖².

    Returns:
        the new θ (same keys as ``theta``), the mean of f over the steps (at each step's start; a float64
        0-dim tensor), and the buffers after the last step's forward pass.
    """
    total = torch.zeros((), dtype=torch.float64)
    for _ in range(steps):
        grads, loss, buffers = grad_fn(theta, buffers)
        theta = {k: t - lr * (grads[k] + lam * (t - w[k])) for k, t in theta.items()}
        total = total + loss.double()
    return theta, total / steps, buffers


def local_update(w: Params, theta: Params, lam: float, lr: float) -> Params:
    """w ← w − η λ (w − θ): the local model's step towards the personalized θ (Alg. 1)."""
    return {k: v - lr * lam * (v - theta[k]) for k, v in w.items()}


def beta_mix(previous: Params, average: Params, beta: float) -> Params:
    """(1 − β) Θ + β Θ̄ per floating-point tensor (Alg. 1); integer buffers are Θ̄'s. β = 1 gives Θ̄."""
    return {k: (1 - beta) * previous[k] + beta * v if v.is_floating_point() else v for k, v in average.items()}


@dataclass(frozen=True)
class PFedMeStep(Step):
    """Alg. 1 on one mini-batch: K inner steps for θ (:func:`inner_solution`), then one step of w
    (:func:`local_update`). The state holds θ and w (``theta/<name>``, ``w/<name>`` for the ``parameters``)
    and the model's buffers, which follow the inner steps and go with both; the loss returned is f(θ; D)
    averaged over the inner steps."""

    work = "pFedMe's local steps"
    parameters: tuple[str, ...]
    lam: float
    k: int
    personal_lr: float
    lr: float

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        def loss(theta: Params, buffers: Params) -> tuple[torch.Tensor, Params]:
            logits, statistics = network({**buffers, **theta}, batch.x, batch.mask)
            return masked_cross_entropy(logits, batch.y, batch.mask), statistics

        def grad_fn(theta: Params, buffers: Params) -> tuple[Params, torch.Tensor, Params]:
            grads, (value, statistics) = grad_and_value(loss, has_aux=True)(theta, buffers)
            return grads, value, statistics

        theta, w = ({k: state[f"{part}/{k}"] for k in self.parameters} for part in ("theta", "w"))
        buffers = {k: v for k, v in state.items() if "/" not in k}
        theta, mean, buffers = inner_solution(grad_fn, theta, w, buffers, self.lam, self.personal_lr, self.k)
        w = local_update(w, theta, self.lam, self.lr)
        return StepOutput({**buffers, **prefixed(theta, "theta"), **prefixed(w, "w")}, mean, sample_count(batch))


def model_of(state: Params, part: str, keys: list[str]) -> Params:
    """The model ``part`` (``theta`` or ``w``) of a :class:`PFedMeStep` state: its parameters and the buffers,
    in the order of ``keys``."""
    return {k: state.get(f"{part}/{k}", state.get(k)) for k in keys}


class PFedMe(FedAvg):
    """pFedMe (Dinh et al., NeurIPS 2020): personalized models from Moreau envelopes.

    Clients upload w after Alg. 1's bi-level updates and keep θ; the server mixes by β.
    """

    name = "pfedme"
    config_class = PFedMeConfig

    def __init__(self, config: PFedMeConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("pfedme", context, "θ and w (Alg. 1)")
        self.parameter_names = tuple(name for name, _ in context.architecture.named_parameters())

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """The client's own θ; before its first training, the received global model."""
        return self.own_model(client_id, message)

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """Alg. 1's client: from w = θ = Θ (``message``), per mini-batch K inner steps for θ, then one step of w."""
        cfg = self.config
        step = PFedMeStep(self.parameter_names, cfg.lam, cfg.k, cfg.personal_lr, self.context.federation.lr)
        start = {k: message[k] for k in self.parameter_names}
        buffers = {k: v for k, v in message.items() if k not in start}
        state = {**buffers, **prefixed(start, "theta"), **prefixed(start, "w")}
        result: StepResult = yield self.step_task(client_id, step, state, round_, "local_training")
        theta, w = (model_of(result.state, part, list(message)) for part in ("theta", "w"))
        return TrainResult(theta, result.loss, result.samples_seen, upload=w)

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        previous = self.global_params
        super().aggregate(messages, round_)  # self.global_params = Θ̄
        self.global_params = beta_mix(previous, self.global_params, self.config.beta)

    def global_model(self, round_: int) -> Params:
        return self.global_params
