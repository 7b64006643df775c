r"""FedDyn (Acar, Zhao, Matas, Mattina, Whatmough and Saligrama, ICLR 2021, arXiv:2111.04263): federated learning
with dynamic regularization.

Each client's objective is regularized so that the clients' stationary points agree with the global one.
Client i keeps :math:`\nabla L_i(\theta_i^{t-1})`, the gradient its first-order condition gives (zeros before
its first training; the store key ``feddyn_grad``). Round t (Alg. 1), on each sampled client i of
:math:`P_t`, from the received :math:`\theta^{t-1}`:

- :math:`\theta_i^t = \arg\min_\theta L_i(\theta) - \langle \nabla L_i(\theta_i^{t-1}), \theta\rangle
  + \frac{\alpha}{2} \lVert \theta - \theta^{t-1} \rVert^2`, approximately: ``federation.local_epochs``
  epochs of plain SGD at ``federation.lr`` on it (``local_train``, the step task :class:`FedDynStep` on
  stream "local_training"; the regularizer is :func:`dynamic_regularizer`), α = ``method.alpha``;
- :math:`\nabla L_i(\theta_i^t) = \nabla L_i(\theta_i^{t-1}) - \alpha (\theta_i^t - \theta^{t-1})`
  (:func:`gradient_update`), kept when it uploads :math:`\theta_i^t` (``client_message``).

Server (``aggregate``, :func:`server_update`), m all clients:
:math:`h^t = h^{t-1} - \alpha \frac{1}{m} \sum_{i \in P_t} (\theta_i^t - \theta^{t-1})` (:math:`h^0 = 0`), then
:math:`\theta^t = \frac{1}{|P_t|} \sum_{i \in P_t} \theta_i^t - \frac{1}{\alpha} h^t`. Both are server state.
The server sends :math:`\theta^t`, a client uploads :math:`\theta_i^t`: one model each way. A client evaluates
the received :math:`\theta^t` (``method.ala`` composes: the local steps then start from ALA's model, the
regularizer and the state update still use the received :math:`\theta^{t-1}`). The steps are functional
(torch.func) plain gradient steps, so ``federation.momentum`` must be 0; the reported loss is the
cross-entropy without the regularizer.

As PFLlib (``clientdyn.py``, ``serverdyn.py``): the means over :math:`P_t` are unweighted, the linear and the
proximal terms cover the model's parameters, and its ``-al`` default α = 1 is plfl's. Departures:

- PFLlib's proximal term is :math:`\frac{\alpha}{2} \lVert \theta - \theta^{t-1} \rVert` (``torch.norm``,
  not squared), while its state update keeps the squared term's :math:`\alpha(\theta_i^t - \theta^{t-1})`;
  plfl follows Alg. 1 (``method.penalty: squared``) and offers PFLlib's form as ``method.penalty: unsquared``,
  which the comparison with PFLlib sets (``benchmarks/pfllib_parity.py``), so that both sides train the same
  objective;
- PFLlib divides the sum of the uploads by the number of clients it meant to sample (``num_join_clients``),
  plfl by the number that uploaded, :math:`|P_t|` (the two agree unless a client fails);
- buffers (BatchNorm's running statistics, ``model.batch_norm``) carry no h: the server takes the uploads'
  unweighted mean of the floating-point ones and the first upload's integer ones, as FedAvg does. PFLlib's
  global model takes the first upload's buffers, and its clients keep their own (it sends parameters only);
- PFLlib's logged training loss includes the regularizer; plfl's is the cross-entropy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import grad_and_value

from plfl.fields import checked, one_of
from plfl.methods.base import FederationContext, require_plain_steps
from plfl.methods.fedavg import FedAvg, FedAvgConfig
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

GRADIENT = "grad/"  # ∇L_i(θ_i^{t−1}) in a step's inputs, per parameter name
ANCHOR = "anchor/"  # θ^{t−1} in a step's shared tensors, per parameter name
CLIENT_GRADIENT = "feddyn_grad"  # the store's key of ∇L_i(θ_i^{t−1})


@dataclass
class FedDynConfig(FedAvgConfig):
    """FedDyn's keys (Acar et al., ICLR 2021, Alg. 1); the local steps take ``federation.lr`` for
    ``federation.local_epochs`` epochs. Derived from FedAvgConfig, so ``method.ala`` works here too."""

    alpha: float = checked(
        1.0,
        lambda v: v > 0,
        "a number > 0",
        "α: weight of the dynamic regularizer and of the server's correction h/α (Alg. 1); PFLlib's -al "
        "default 1 (the paper's experiments take far smaller values, such as 0.01)",
    )
    penalty: str = one_of(
        "squared",
        ("squared", "unsquared"),
        "the proximal term: squared, α/2‖θ − θ^{t−1}‖² (Alg. 1); unsquared, α/2‖θ − θ^{t−1}‖ as PFLlib's "
        "clientdyn.py (its parity comparison sets it)",
    )


def dynamic_regularizer(
    params: Params, anchor: Params, gradient: Params, alpha: float, squared: bool = True
) -> torch.Tensor:
    """−⟨∇L_i(θ_i^{t−1}), θ⟩ + α/2 ‖θ − θ^{t−1}‖² (Alg. 1's local objective without L_i), a 0-dim tensor; with
    ``squared`` false, PFLlib's α/2 ‖θ − θ^{t−1}‖ (the norm of the whole parameter vector, its gradient 0 at
    θ = θ^{t−1}).

    Args:
        params: θ, parameter name → tensor; anchor: θ^{t−1}, the same keys and shapes; gradient:
            ∇L_i(θ_i^{t−1}), likewise; alpha: α > 0.
    """
    linear = torch.stack([(gradient[k] * p).sum() for k, p in params.items()]).sum()
    if squared:
        distance = torch.stack([(p - anchor[k]).square().sum() for k, p in params.items()]).sum()
    else:  # a norm of the tensors' norms: the whole vector's, with a zero (not NaN) gradient at θ = θ^{t−1}
        distance = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p - anchor[k]) for k, p in params.items()])
        )
    return alpha / 2 * distance - linear


def gradient_update(gradient: Params, trained: Params, anchor: Params, alpha: float) -> Params:
    """∇L_i(θ_i^t) = ∇L_i(θ_i^{t−1}) − α (θ_i^t − θ^{t−1}) (Alg. 1), for ``gradient``'s keys (the parameters).

    Args:
        gradient: ∇L_i(θ_i^{t−1}); trained: θ_i^t (at least its keys); anchor: θ^{t−1} (likewise); alpha: α.
    """
    return {k: g - alpha * (trained[k] - anchor[k]) for k, g in gradient.items()}


def server_update(
    global_params: Params, h: Params, uploads: list[Params], alpha: float, num_clients: int
) -> tuple[Params, Params]:
    """The server's step (Alg. 1): h^t = h^{t−1} − α (1/m) Σ_{P_t} (θ_i^t − θ^{t−1}),
    θ^t = (1/|P_t|) Σ_{P_t} θ_i^t − h^t / α.

    Args:
        global_params: θ^{t−1}, every state_dict key; h: h^{t−1}, a key per parameter (the keys h applies to);
        uploads: the θ_i^t of P_t, θ's keys; alpha: α; num_clients: m, all clients.

    Returns:
        (θ^t, h^t), new tensors. Floating-point buffers are the uploads' mean, integer ones the first upload's.

    Raises:
        ValueError: no uploads.
    """
    if not uploads:
        raise ValueError("FedDyn's server step needs at least one upload")
    new_h = {
        k: v - alpha / num_clients * torch.stack([u[k] - global_params[k] for u in uploads]).sum(0)
        for k, v in h.items()
    }
    params = {}
    for key, first in uploads[0].items():
        if not first.is_floating_point():
            params[key] = first.clone()
            continue
        mean = torch.stack([u[key] for u in uploads]).mean(0)
        params[key] = mean - new_h[key] / alpha if key in new_h else mean
    return params, new_h


@dataclass(frozen=True)
class FedDynStep(Step):
    """One SGD step on Alg. 1's local objective L_i(θ; batch) + :func:`dynamic_regularizer`. The state is θ (the
    ``parameters``) and the model's buffers (which follow the forward pass); the inputs hold ∇L_i(θ_i^{t−1})
    under ``grad/<name>``, the shared tensors θ^{t−1} under ``anchor/<name>``. The loss returned is the batch's
    cross-entropy."""

    work = "FedDyn's regularized local steps"
    parameters: tuple[str, ...]
    alpha: float
    lr: float
    squared: bool

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        anchor = {k: shared[ANCHOR + k] for k in self.parameters}
        gradient = {k: inputs[GRADIENT + k] for k in self.parameters}

        def objective(theta: Params, buffers: Params) -> tuple[torch.Tensor, tuple[torch.Tensor, Params]]:
            logits, statistics = network({**buffers, **theta}, batch.x, batch.mask)
            loss = masked_cross_entropy(logits, batch.y, batch.mask)
            return loss + dynamic_regularizer(theta, anchor, gradient, self.alpha, self.squared), (loss, statistics)

        theta = {k: state[k] for k in self.parameters}
        buffers = {k: v for k, v in state.items() if k not in theta}
        grads, (_, (loss, buffers)) = grad_and_value(objective, has_aux=True)(theta, buffers)
        theta = {k: t - self.lr * grads[k] for k, t in theta.items()}
        return StepOutput({**buffers, **theta}, loss, sample_count(batch))


class FedDyn(FedAvg):
    """FedDyn (Acar et al., ICLR 2021): local objectives with a dynamic regularizer, a corrected server model.

    Clients minimise L_i − ⟨∇L_i(θ_i^{t−1}), θ⟩ + α/2‖θ − θ^{t−1}‖²; the server subtracts h/α from the mean.
    """

    name = "feddyn"
    not_averaging = "corrects the mean of the uploads by its server state h, an update no rule replaces"
    config_class = FedDynConfig
    server_state = ("global_params", "h")
    # 3 of 5 clients a round: h moves by Σ/m, a client's gradient state waits through the rounds it sits out.
    matrix_options = {"federation.join_ratio": 0.6}

    def __init__(self, config: FedDynConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("feddyn", context, "θ (Alg. 1's regularized local objective)")
        self.parameter_names = tuple(name for name, _ in context.architecture.named_parameters())
        self.h: Params = {k: torch.zeros_like(initial_params[k]) for k in self.parameter_names}

    def client_gradient(self, client_id: int) -> Params:
        """∇L_i(θ_i^{t−1}) from the store; zeros before the client's first upload."""
        return self.store.get(client_id, CLIENT_GRADIENT) or {k: torch.zeros_like(v) for k, v in self.h.items()}

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """``federation.local_epochs`` epochs of SGD on Alg. 1's local objective from ``params`` (the received
        θ^{t−1}, or ALA's model), regularized towards the received θ^{t−1} (``message``)."""
        cfg = self.config
        step = FedDynStep(self.parameter_names, cfg.alpha, self.context.federation.lr, cfg.penalty == "squared")
        gradient = self.client_gradient(client_id)
        result: StepResult = yield self.step_task(
            client_id,
            step,
            dict(params),
            round_,
            "local_training",
            inputs={GRADIENT + k: v for k, v in gradient.items()},
            shared={ANCHOR + k: message[k] for k in self.parameter_names},
        )
        trained = {k: result.state[k] for k in params}  # the model's key order
        return TrainResult(trained, result.loss, result.samples_seen)

    def client_message(self, client_id: int, result: TrainResult, round_: int) -> Params:
        """θ_i^t; the client keeps ∇L_i(θ_i^t) (:func:`gradient_update`), now that its training succeeded (a
        failed client's state stays as it was). θ^{t−1} is the server's model, unchanged since the broadcast
        that sent it."""
        anchor = self.global_params
        self.store.set(
            client_id,
            CLIENT_GRADIENT,
            gradient_update(self.client_gradient(client_id), result.params, anchor, self.config.alpha),
        )
        return result.params

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        self.global_params, self.h = server_update(
            self.global_params, self.h, list(messages.values()), self.config.alpha, len(self.context.data.clients)
        )
