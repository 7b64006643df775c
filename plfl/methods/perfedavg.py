"""Per-FedAvg (Fallah, Mokhtari and Ozdaglar, NeurIPS 2020, arXiv:2002.07948): FedAvg of MAML steps.

The clients learn a shared w that one gradient step adapts to each of them: the objective is
F(w) = 1/n Σ_i f_i(w − α∇f_i(w)), with ∇F_i(w) = (I − α∇²f_i(w)) ∇f_i(w − α∇f_i(w)). Client
(``local_train``, Algorithm 1, the step task :class:`PerFedAvgStep`): from the received global w,
each step draws batches D, D′ (, D″),
takes the temporary step w̃ = w − α∇f_i(w; D), then

- FO (Per-FedAvg (FO)): w ← w − β∇f_i(w̃; D′), the Hessian term dropped;
- HF (Per-FedAvg (HF)): w ← w − β(I − α∇²f_i(w; D″))∇f_i(w̃; D′).

Server (``aggregate``): FedAvg's average. Evaluated (``pre_local_init``, PFLlib's
``evaluate_one_step``): the received w after one step of α on one training batch; the next
round's training starts from the received w again. As PFLlib's ``clientperavg.py``: a step takes
one loader batch of 2B samples (3B for HF; B = ``federation.batch_size``, plfl's seeded order)
split into D, D′ (, D″) of B each, and α = β = ``federation.lr`` by default.
Departures: HF's Hessian-vector product is exact (double backward, the Hessian never formed),
where the paper takes a gradient difference with a small δ; PFLlib has no HF. PFLlib drops the
last short loader batch; here it is used while it holds a sample for each of D, D′ (, D″), two
with BatchNorm (:func:`plfl.batches.last_batch_minimum`).
PFLlib's server calls each client's ``train()`` twice per round; ``federation.local_epochs=2``
matches that. PFLlib draws the evaluation batch from torch's global generator, seeded with 0 once
per process, so the k-th run of every process evaluates a round on the same batches (the
documentation's fidelity page, "Beside PFLlib"). Here the batch is drawn from (``federation.seed``, round, client).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.func import grad, grad_and_value

from plfl.batches import has_batch_norm, last_batch_minimum
from plfl.fields import checked, one_of
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
    sample_count,
)

# f(w; D) with the model's buffers: (w, buffers, D) → (the scalar loss, the buffers after the forward pass).
Loss = Callable[[Params, Params, Batch], tuple[torch.Tensor, Params]]


@dataclass
class PerFedAvgConfig(MethodConfig):
    """Per-FedAvg's keys (Fallah et al., NeurIPS 2020, Algorithm 1 and Sec. 5). It evaluates a one-step
    adapted model from its own ``pre_local_init``, so it takes no ``method.ala``."""

    variant: str = one_of(
        "fo",
        ("fo", "hf"),
        "fo: first-order step, Hessian term dropped; hf: with the exact Hessian-vector product on a third batch D''",
    )
    alpha: Optional[float] = checked(
        None,
        lambda v: v is None or v > 0,
        "null or a number > 0",
        "α: step size of the temporary step and of the evaluated one-step "
        "adaptation; null: federation.lr, as PFLlib (clientperavg.py)",
    )
    beta: Optional[float] = checked(
        None,
        lambda v: v is None or v > 0,
        "null or a number > 0",
        "β: step size of the meta update; null: federation.lr, as PFLlib "
        "(clientperavg.py sets beta to the local learning rate)",
    )


def hessian_vector_product(
    loss: Loss, params: Params, buffers: Params, vector: Params, batch: Batch
) -> tuple[Params, Params]:
    """∇²f(w; D″) v by double backward: the gradient of ⟨∇f(w; D″), v⟩; the Hessian is never formed.

    Args:
        loss: f, twice differentiable in its params; params: w; buffers: the model's; vector: v, the same keys
            and shapes as w; batch: D″.

    Returns:
        the product (w's keys and shapes) and the buffers after the forward pass.
    """

    def directional(w: Params) -> tuple[torch.Tensor, Params]:
        gradient, statistics = grad(loss, has_aux=True)(w, buffers, batch)
        return sum((gradient[k] * vector[k]).sum() for k in gradient), statistics

    return grad(directional, has_aux=True)(params)


def meta_gradient(
    loss: Loss, params: Params, buffers: Params, batches: list[Batch], alpha: float
) -> tuple[Params, torch.Tensor, Params]:
    """Per-FedAvg's stochastic gradient of F_i at w, and f(w; D).

    Args:
        loss: f; params: w (name → tensor); buffers: the model's, updated by each forward pass in turn;
            alpha: α > 0.
        batches: [D, D′] for FO: ∇f(w̃; D′) with w̃ = w − α∇f(w; D); [D, D′, D″] for HF:
            (I − α∇²f(w; D″)) ∇f(w̃; D′).

    Returns:
        (the gradient, same keys and shapes as ``params``; f(w; D); the buffers after the last forward pass).
    """
    first, outer, *hessian = batches
    inner, (value, buffers) = grad_and_value(loss, has_aux=True)(params, buffers, first)
    adapted = {k: params[k] - alpha * inner[k] for k in params}
    outer_gradient, buffers = grad(loss, has_aux=True)(adapted, buffers, outer)
    if hessian:
        product, buffers = hessian_vector_product(loss, params, buffers, outer_gradient, hessian[0])
        outer_gradient = {k: g - alpha * product[k] for k, g in outer_gradient.items()}
    return outer_gradient, value, buffers


def cross_entropy(network: Network) -> Loss:
    """f(w; D): the network's mean cross-entropy on D's real samples with parameters w and the given buffers."""

    def loss(params: Params, buffers: Params, batch: Batch) -> tuple[torch.Tensor, Params]:
        logits, statistics = network({**params, **buffers}, batch.x, batch.mask)
        return masked_cross_entropy(logits, batch.y, batch.mask), statistics

    return loss


@dataclass(frozen=True)
class PerFedAvgStep(Step):
    """Algorithm 1 on one loader batch of ``len(parts)`` B samples, split into D, D′ (, D″) of ``sub_batch``
    B each: w ← w − β · :func:`meta_gradient`. The state is w (the ``parameters``) and the model's buffers;
    the loss returned is f(w; D), a mean over D."""

    work = "Per-FedAvg's local steps"
    parameters: tuple[str, ...]
    alpha: float
    beta: float
    hf: bool
    sub_batch: int

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        masks = [None] * (3 if self.hf else 2) if batch.mask is None else batch.mask.split(self.sub_batch)
        parts = [Batch(*part) for part in zip(batch.x.split(self.sub_batch), batch.y.split(self.sub_batch), masks)]
        w = {k: state[k] for k in self.parameters}
        buffers = {k: v for k, v in state.items() if k not in w}
        gradient, value, buffers = meta_gradient(cross_entropy(network), w, buffers, parts, self.alpha)
        return StepOutput(
            {**buffers, **{k: v - self.beta * gradient[k] for k, v in w.items()}}, value, sample_count(parts[0])
        )


@dataclass(frozen=True)
class AdaptationStep(Step):
    """One gradient step of α on f(w; D): the evaluated model. The state is w (the ``parameters``) and the
    model's buffers."""

    work = "Per-FedAvg's adaptation"
    parameters: tuple[str, ...]
    alpha: float

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        w = {k: state[k] for k in self.parameters}
        buffers = {k: v for k, v in state.items() if k not in w}
        gradient, (value, buffers) = grad_and_value(cross_entropy(network), has_aux=True)(w, buffers, batch)
        return StepOutput(
            {**buffers, **{k: v - self.alpha * gradient[k] for k, v in w.items()}}, value, sample_count(batch)
        )


class PerFedAvg(FedAvg):
    """Per-FedAvg (Fallah et al., NeurIPS 2020): FedAvg of MAML steps, one-step adapted.

    FedAvg's server; the clients take Per-FedAvg's steps and are evaluated one step adapted.
    """

    name = "perfedavg"
    config_class = PerFedAvgConfig

    def __init__(self, config: PerFedAvgConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("perfedavg", context, "w (Algorithm 1's meta-steps)")
        lr = context.federation.lr
        self.alpha = lr if config.alpha is None else config.alpha
        self.beta = lr if config.beta is None else config.beta
        self.batches_per_step = 3 if config.variant == "hf" else 2
        self.parameter_names = tuple(name for name, _ in context.architecture.named_parameters())
        self.batch_norm = has_batch_norm(context.architecture)

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Work[Params]:
        """The evaluated model: the received w after one step of α on one training batch of B samples
        (stream "adaptation")."""
        result: StepResult = yield self.step_task(
            client_id, AdaptationStep(self.parameter_names, self.alpha), message, round_, "adaptation", steps=1
        )
        return {k: result.state[k] for k in message}

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """``federation.local_epochs`` passes of Per-FedAvg steps (Algorithm 1) from the received global
        model (``message``), not from ``params`` (the evaluated, adapted one). The loss reported is f(w; D)."""
        k, batch_size = self.batches_per_step, self.context.federation.batch_size
        step = PerFedAvgStep(self.parameter_names, self.alpha, self.beta, k == 3, batch_size)
        result: StepResult = yield self.step_task(
            client_id,
            step,
            message,
            round_,
            "local_training",
            batch_size=k * batch_size,
            min_last_batch=last_batch_minimum(k * batch_size, self.batch_norm, k),
        )
        return TrainResult({key: result.state[key] for key in message}, result.loss, result.samples_seen)
