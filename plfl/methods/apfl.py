"""APFL (Deng, Kamani and Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461): a learned mix.

Client i keeps a local model v_i and a mixing weight α_i ∈ [0, 1]; its personalized model is the mix

    v̄_i = α_i v_i + (1 − α_i) w_i                                                  (``mix``)

of v_i and its copy w_i of the global model. Per round (Alg. 1), a sampled client starts w_i from the
received global w and v_i, α_i from its own state (the store; before its first training the initial
model and ``method.alpha``), and, per mini-batch ξ of ``federation.local_epochs`` epochs (stream
"local_training", the one batch order of every method), takes one step in all three at the same point
(``local_train``, the step task :class:`APFLStep`; :func:`apfl_update`):

    w_i ← w_i − η ∇f_i(w_i; ξ)
    v_i ← v_i − η ∇_v f_i(v̄_i; ξ)          = v_i − η α_i ∇f_i(v̄_i; ξ)
    α_i ← clip(α_i − η_α ∇_α f_i(v̄_i; ξ), 0, 1),   ∇_α f_i(v̄_i) = ⟨v_i − w_i, ∇f_i(v̄_i; ξ)⟩

(η = ``federation.lr``; η_α = ``method.alpha_lr``, by default η, as PFLlib steps α). The client uploads w_i
alone; the server sets w to the sample-weighted mean of the uploads (FedAvg's ``aggregate``). At the
broadcast every client mixes its own v_i and α_i with the received w (``pre_local_init``): that v̄_i is
what is evaluated; ``round_metrics`` logs the clients' mean α_i.

BatchNorm: w_i's running statistics follow w_i's forward passes and travel with it (averaged as
FedAvg's); v_i's follow the forward passes of v̄_i, so they are v̄_i's statistics, and v̄_i takes
them (floating buffers are not mixed). The reported loss is f_i(v̄_i; ξ) before each step.

ALA (``method.ala``) is refused: although w_i starts from the received model, ALA's output would be
the model handed to ``local_train``, which APFL does not train from (w_i restarts from the received
model, v_i and α_i come from the store), so ALA would change only the evaluated mix, whose weight α_i
APFL already learns.

Departures from the paper: the server's mean is weighted by the clients' training samples, as
PFLlib's serverbase.py (Alg. 1: the plain mean over the sampled clients); the three steps are plain
gradient steps (``federation.momentum`` must be 0, no ``data.augment``). PFLlib's clientapfl.py
differs from the paper, and plfl follows the paper: PFLlib steps v on ∇f(v) (the loss of v alone, not
of v̄), steps α along FedTorch's ⟨v − w, α ∇f(v) + (1 − α) ∇f(w)⟩ + 0.02 α taken after the w and v steps,
replaces v by v̄ after each round's training (v̄ with the client's own trained w), evaluates that v̄, and
reads the initial α from its shared ``-al`` flag (default 1.0); the authors' FedTorch mixes the two
models' outputs, not their parameters, and moves α once per round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
    non_finite,
    prefixed,
    sample_count,
)

LOCAL_MODEL = "local_model"  # store key: v_i, a state dict of the model (its buffers: v̄_i's statistics)
ALPHA = "alpha"  # store key: α_i, a 0-dim float32 tensor


@dataclass
class APFLConfig(MethodConfig):
    """APFL's keys (Deng et al., 2020, Alg. 1); η of the three local steps is ``federation.lr``. The kept
    local model and mixing weight are APFL's own local initialisation, so there is no ``method.ala``."""

    alpha: float = checked(
        0.5,
        lambda v: 0 <= v <= 1,
        "a number in [0, 1]",
        "α_i's initial value: the weight of the local model v_i in v̄_i = α_i v_i + (1 − α_i) w_i "
        "(the authors' FedTorch default 0.5; PFLlib's shared -al default is 1.0)",
    )
    alpha_lr: Optional[float] = checked(
        None,
        lambda v: v is None or v >= 0,
        "null or a number >= 0",
        "η_α: step size of α_i (0 keeps α_i fixed); null: federation.lr, as Alg. 1 and PFLlib step α",
    )


def mix(local: Params, global_copy: Params, alpha: torch.Tensor, parameters: tuple[str, ...]) -> Params:
    """v̄ = α v + (1 − α) w for the ``parameters``; every other tensor (buffers) is ``local``'s.

    Args:
        local: v, a state dict of the model.
        global_copy: w, with at least the ``parameters`` (same shapes as ``local``'s).
        alpha: α, a 0-dim tensor in [0, 1].
        parameters: the names of the model's parameters.

    Returns:
        v̄ in ``local``'s key order.
    """
    return {k: alpha * v + (1 - alpha) * global_copy[k] if k in parameters else v for k, v in local.items()}


def apfl_update(
    w: Params,
    v: Params,
    alpha: torch.Tensor,
    grad_w: Params,
    grad_mix: Params,
    lr: float,
    alpha_lr: float,
) -> tuple[Params, Params, torch.Tensor]:
    """One step of Alg. 1 in w, v and α, all at the same point:

    w ← w − η ∇f(w);  v ← v − η α ∇f(v̄);  α ← clip(α − η_α ⟨v − w, ∇f(v̄)⟩, 0, 1),

    where ∇f(v̄) is the gradient of the loss at the mix v̄ = α v + (1 − α) w (so α ∇f(v̄) = ∇_v f(v̄) and
    ⟨v − w, ∇f(v̄)⟩ = ∇_α f(v̄), summed over all tensors).

    Args:
        w: the parameters of w, by name.
        v: the parameters of v (the same names and shapes).
        alpha: α, a 0-dim tensor.
        grad_w: ∇f(w), by name.
        grad_mix: ∇f(v̄), by name.
        lr: η, the step size of w and v.
        alpha_lr: η_α, the step size of α.

    Returns:
        (new w, new v, new α), new tensors.
    """
    grad_alpha = torch.stack([((v[k] - w[k]) * grad_mix[k]).sum() for k in v]).sum()
    new_w = {k: t - lr * grad_w[k] for k, t in w.items()}
    new_v = {k: t - lr * alpha * grad_mix[k] for k, t in v.items()}
    return new_w, new_v, torch.clamp(alpha - alpha_lr * grad_alpha, 0.0, 1.0)


@dataclass(frozen=True)
class APFLStep(Step):
    """Alg. 1 on one mini-batch (:func:`apfl_update`). The state holds w and v (every tensor of the model as
    ``w/<name>`` and ``v/<name>``) and ``alpha`` (α, 0-dim); the loss returned is f(v̄) before the step."""

    work = "APFL's local steps"
    parameters: tuple[str, ...]
    lr: float
    alpha_lr: float

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        w_model, v_model = (model_of(state, part) for part in ("w", "v"))
        w = {k: w_model[k] for k in self.parameters}
        v = {k: v_model[k] for k in self.parameters}

        def loss(params: Params, buffers: Params) -> tuple[torch.Tensor, Params]:
            logits, statistics = network({**buffers, **params}, batch.x, batch.mask)
            return masked_cross_entropy(logits, batch.y, batch.mask), statistics

        grad_w, (_, w_statistics) = grad_and_value(loss, has_aux=True)(w, w_model)
        mixed = mix(v, w, state[ALPHA], self.parameters)
        grad_mix, (value, v_statistics) = grad_and_value(loss, has_aux=True)(mixed, v_model)
        new_w, new_v, alpha = apfl_update(w, v, state[ALPHA], grad_w, grad_mix, self.lr, self.alpha_lr)
        new_state = {
            **prefixed({**w_model, **w_statistics, **new_w}, "w"),
            **prefixed({**v_model, **v_statistics, **new_v}, "v"),
            ALPHA: alpha,
        }
        return StepOutput(new_state, value, sample_count(batch))


def model_of(state: Params, part: str) -> Params:
    """The model ``part`` (``w`` or ``v``) of an :class:`APFLStep` state, by the model's names."""
    return {k.removeprefix(f"{part}/"): v for k, v in state.items() if k.startswith(f"{part}/")}


class APFL(FedAvg):
    """APFL (Deng et al., 2020): each client mixes its local model with the global one, the weight learned.

    Clients step w, v and α per mini-batch (Alg. 1), upload w and evaluate α v + (1 − α) w.
    """

    name = "apfl"
    config_class = APFLConfig
    matrix_options = {"federation.batch_size": 7}  # short last batches: padding in the vectorized steps

    def __init__(self, config: APFLConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("apfl", context, "w, v and α (Alg. 1)")
        self.parameter_names = tuple(name for name, _ in context.architecture.named_parameters())

    def client_state(self, client_id: int, received: Params) -> tuple[Params, torch.Tensor]:
        """(v_i, α_i) from the store; before the client's first training, a copy of ``received`` (the
        initial model) and ``method.alpha``."""
        local = self.store.get(client_id, LOCAL_MODEL) or {k: t.clone() for k, t in received.items()}
        alpha = self.store.get(client_id, ALPHA)
        return local, torch.tensor(float(self.config.alpha)) if alpha is None else alpha

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """The personalized model v̄_i = α_i v_i + (1 − α_i) w of the client's own v_i, α_i and the received w."""
        local, alpha = self.client_state(client_id, message)
        return mix(local, message, alpha, self.parameter_names)

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """Alg. 1's client: w from the received ``message``, v and α from the store, one step of all three per
        mini-batch; keeps v and α (unless training diverged), uploads w, returns v̄ with the trained w."""
        federation = self.context.federation
        alpha_lr = federation.lr if self.config.alpha_lr is None else self.config.alpha_lr
        local, alpha = self.client_state(client_id, message)
        step = APFLStep(self.parameter_names, federation.lr, alpha_lr)
        state = {**prefixed(message, "w"), **prefixed(local, "v"), ALPHA: alpha}
        result: StepResult = yield self.step_task(client_id, step, state, round_, "local_training")
        w, v = model_of(result.state, "w"), model_of(result.state, "v")
        w, v = ({k: model[k] for k in message} for model in (w, v))  # the model's key order
        alpha = result.state[ALPHA]
        if non_finite(w) is None and non_finite(v) is None and torch.isfinite(alpha):
            self.store.set(client_id, LOCAL_MODEL, v)  # a diverged client keeps its state and fails
            self.store.set(client_id, ALPHA, alpha)
        return TrainResult(mix(v, w, alpha, self.parameter_names), result.loss, result.samples_seen, upload=w)

    def round_metrics(self, round_: int) -> dict[str, float]:
        """``alpha_mean``: the clients' mean α_i (``method.alpha`` for those yet to train)."""
        alphas = [self.store.get(i, ALPHA) for i in range(len(self.store))]
        return {"alpha_mean": sum(self.config.alpha if a is None else a.item() for a in alphas) / len(alphas)}
