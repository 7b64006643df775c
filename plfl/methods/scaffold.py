r"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich and Suresh, ICML 2020, arXiv:1910.06378): local steps
corrected by control variates.

The server keeps the global model x and a control variate c; client i keeps its own control variate
:math:`c_i` (zeros before its first training). Round t (Alg. 1), on each sampled client i of S:

- :math:`y_i \leftarrow x`, then K local steps :math:`y_i \leftarrow y_i - \eta_l (g_i(y_i) + c - c_i)`
  (line 10; ``local_train``, the step task :class:`ScaffoldStep` on stream "local_training", K the batches of
  ``federation.local_epochs`` epochs, :math:`\eta_l` = ``federation.lr``; :func:`corrected_step`);
- option II (line 12): :math:`c_i^+ = c_i - c + \frac{1}{K \eta_l}(x - y_i)`, so that
  :math:`\Delta c_i = c_i^+ - c_i = \frac{1}{K\eta_l}(x - y_i) - c` (:func:`control_delta`);
- it uploads :math:`(\Delta y_i, \Delta c_i) = (y_i - x, c_i^+ - c_i)` (line 13) and keeps
  :math:`c_i \leftarrow c_i^+` (line 14; the store key ``scaffold_c``, written when it uploads,
  ``client_message``).

Server (lines 16–17; ``aggregate``, :func:`server_update`):
:math:`x \leftarrow x + \eta_g \frac{1}{|S|} \sum_{i \in S} \Delta y_i`,
:math:`c \leftarrow c + \frac{1}{N} \sum_{i \in S} \Delta c_i` (N: all clients; the paper's
:math:`\frac{|S|}{N}` times the mean), :math:`\eta_g` = ``method.server_lr``.

Both control variates travel: the server sends x and c (``server_message``: the model's keys and
``control/<name>`` for every parameter), a client uploads :math:`\Delta y_i` (``delta/<key>``) and
:math:`\Delta c_i` (``control/<name>``), so each way carries a model and a parameter-sized c. The client's
model, what it evaluates, is the received x (``pre_local_init`` drops c; ``method.ala`` composes with it). The
server's x and c are its state (``server_state``). The steps are functional (torch.func) plain gradient steps,
so ``federation.momentum`` must be 0; the reported loss is the cross-entropy.

As PFLlib (``clientscaffold.py``, ``serverscaffold.py``, ``SCAFFOLDOptimizer``): K counts the steps the client
took (PFLlib: its loader's batches × epochs), the means over S are unweighted, and :math:`\eta_g` defaults to 1
(PFLlib's ``-slr``). Departures:

- PFLlib divides :math:`\sum \Delta y_i` by the number of clients it meant to sample (``num_join_clients``);
  plfl by the number that uploaded, the size of S (the two agree unless a client fails);
- plfl trains on the incomplete last batch that PFLlib drops (every method's batch order, :mod:`plfl.batches`),
  and it counts in K; a client that took no step (no batch) uploads :math:`\Delta c_i = 0`;
- buffers (BatchNorm's running statistics, ``model.batch_norm``) are not corrected and have no control variate:
  the client uploads :math:`\Delta y` of its floating-point buffers, which the server adds unscaled (so x's
  statistics are the uploads' mean; :math:`\eta_g` is not applied, a running variance must not be
  extrapolated), and an integer buffer's own value, taken from the first upload as FedAvg takes it. PFLlib
  sends and aggregates parameters only, so its clients keep their own statistics and its global model keeps
  the initial ones;
- with ``method.ala``, the local steps start from ALA's model :math:`\hat x_i` rather than x: the control
  variate then uses :math:`\hat x_i - y_i` (the mean corrected step actually taken), while the upload stays
  :math:`y_i - x`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.func import grad_and_value

from plfl.fields import checked
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

CONTROL = "control/"  # c (sent), Δc_i (uploaded), c − c_i (a step's inputs): per parameter name
DELTA = "delta/"  # Δy_i = y_i − x in an upload, per state_dict key
STEPS = "scaffold/steps"  # the steps a ScaffoldStep task took: K (a 0-dim int64 in its state)
CLIENT_CONTROL = "scaffold_c"  # the store's key of c_i


@dataclass
class ScaffoldConfig(FedAvgConfig):
    """SCAFFOLD's keys (Karimireddy et al., ICML 2020, Alg. 1); η_l is ``federation.lr``, K the steps of
    ``federation.local_epochs`` epochs. Derived from FedAvgConfig, so ``method.ala`` works here too."""

    server_lr: float = checked(
        1.0,
        lambda v: v > 0,
        "a number > 0",
        "η_g: the server's step along the mean Δy (Alg. 1 line 16); 1 as the paper's experiments and PFLlib's -slr",
    )


def corrected_step(params: Params, grads: Params, correction: Params, lr: float) -> Params:
    """One local step y ← y − η_l (g_i(y) + c − c_i) (Alg. 1 line 10).

    Args:
        params: y, parameter name → tensor; grads: g_i(y), the same keys and shapes; correction: c − c_i, the
            same keys and shapes; lr: η_l.

    Returns:
        the new y (new tensors, ``params``'s keys).
    """
    return {k: y - lr * (grads[k] + correction[k]) for k, y in params.items()}


def control_delta(server_c: Params, start: Params, trained: Params, steps: int, lr: float) -> Params:
    """Δc_i = c_i⁺ − c_i = (x − y_i) / (K η_l) − c, option II's update (Alg. 1 lines 12–13) without c_i, which
    cancels: the client then keeps c_i⁺ = c_i + Δc_i.

    Args:
        server_c: c, parameter name → tensor; start: x, where the K steps started (at least c's keys);
        trained: y_i after them (likewise); steps: K ≥ 0; lr: η_l > 0.

    Returns:
        Δc_i for c's keys; zeros when K = 0 (a client without a batch took no step and learned nothing).
    """
    if steps == 0:
        return {k: torch.zeros_like(c) for k, c in server_c.items()}
    return {k: (start[k] - trained[k]) / (steps * lr) - c for k, c in server_c.items()}


def server_update(
    global_params: Params,
    server_c: Params,
    deltas: list[Params],
    control_deltas: list[Params],
    num_clients: int,
    server_lr: float,
) -> tuple[Params, Params]:
    """The server's step (Alg. 1 lines 16–17): x ← x + η_g · mean_S(Δy), c ← c + (1/N) Σ_S Δc.

    Args:
        global_params: x, every state_dict key; server_c: c, a key per parameter (the keys η_g applies to).
        deltas: each uploading client's Δy_i, x's keys: y_i − x for floating-point tensors, an integer buffer's
            own value. control_deltas: each one's Δc_i, c's keys. num_clients: N, all clients. server_lr: η_g.

    Returns:
        (x, c), new tensors. Floating-point buffers move by the unscaled mean of their Δy (the mean of the
        clients' statistics); integer buffers are the first upload's, as FedAvg takes them.

    Raises:
        ValueError: no uploads.
    """
    if not deltas:
        raise ValueError("SCAFFOLD's server step needs at least one upload")
    params = {}
    for key, x in global_params.items():
        if not x.is_floating_point():
            params[key] = deltas[0][key].clone()
            continue
        mean = torch.stack([d[key] for d in deltas]).mean(0)
        params[key] = x + (server_lr if key in server_c else 1.0) * mean
    control = {k: c + torch.stack([d[k] for d in control_deltas]).sum(0) / num_clients for k, c in server_c.items()}
    return params, control


@dataclass(frozen=True)
class ScaffoldStep(Step):
    """Alg. 1 line 10 on one mini-batch (:func:`corrected_step`). The state is y (the ``parameters``), the
    model's buffers (which follow the forward pass) and the step count ``scaffold/steps``; the inputs hold
    c − c_i under ``control/<name>``. The loss returned is the batch's cross-entropy."""

    work = "SCAFFOLD's corrected local steps"
    parameters: tuple[str, ...]
    lr: float

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        def loss(y: Params, buffers: Params) -> tuple[torch.Tensor, Params]:
            logits, statistics = network({**buffers, **y}, batch.x, batch.mask)
            return masked_cross_entropy(logits, batch.y, batch.mask), statistics

        y = {k: state[k] for k in self.parameters}
        buffers = {k: v for k, v in state.items() if k not in y and k != STEPS}
        grads, (value, buffers) = grad_and_value(loss, has_aux=True)(y, buffers)
        y = corrected_step(y, grads, {k: inputs[CONTROL + k] for k in self.parameters}, self.lr)
        return StepOutput({**buffers, **y, STEPS: state[STEPS] + 1}, value, sample_count(batch))


def model_of(message: Params) -> Params:
    """The model x of a server message: its tensors but c's (``control/<name>``), in their order."""
    return {k: v for k, v in message.items() if not k.startswith(CONTROL)}


class Scaffold(FedAvg):
    """SCAFFOLD (Karimireddy et al., ICML 2020): local steps corrected by control variates.

    Clients step along g_i(y) + c − c_i and upload Δy and Δc; the server moves x and c (Alg. 1, option II).
    """

    name = "scaffold"
    uploads_model = False
    not_averaging = "aggregates updates and control variates, not client models"
    config_class = ScaffoldConfig
    server_state = ("global_params", "server_c")
    # Short last batches (n mod 7 ≠ 0, K differs between clients) and 3 of 5 clients a round (c_i kept across
    # rounds a client sits out, c moved by |S|/N of the mean).
    matrix_options = {"federation.batch_size": 7, "federation.join_ratio": 0.6}

    def __init__(self, config: ScaffoldConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("scaffold", context, "y (Alg. 1's corrected local steps)")
        self.parameter_names = tuple(name for name, _ in context.architecture.named_parameters())
        self.server_c: Params = {k: torch.zeros_like(initial_params[k]) for k in self.parameter_names}

    def server_message(self, client_id: int, round_: int) -> Params:
        """x and c (under ``control/<name>``)."""
        return {**self.global_params, **{CONTROL + k: c for k, c in self.server_c.items()}}

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Params:
        """The received x: the message without c."""
        return model_of(message)

    def client_control(self, client_id: int) -> Params:
        """c_i from the store; zeros before the client's first upload."""
        return self.store.get(client_id, CLIENT_CONTROL) or {k: torch.zeros_like(c) for k, c in self.server_c.items()}

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """K corrected steps from ``params`` (the received x, or ALA's model), then Δy_i and Δc_i (option II)
        as the upload."""
        x = model_of(message)
        c = {k: message[CONTROL + k] for k in self.parameter_names}
        own = self.client_control(client_id)
        step = ScaffoldStep(self.parameter_names, self.context.federation.lr)
        state = {**params, STEPS: torch.zeros((), dtype=torch.long)}
        inputs = {CONTROL + k: c[k] - own[k] for k in self.parameter_names}
        result: StepResult = yield self.step_task(client_id, step, state, round_, "local_training", inputs=inputs)
        trained = {k: result.state[k] for k in params}  # the model's key order
        steps = int(result.state[STEPS])
        delta_c = control_delta(c, params, trained, steps, self.context.federation.lr)
        upload = {
            **{DELTA + k: v - x[k] if v.is_floating_point() else v for k, v in trained.items()},
            **{CONTROL + k: v for k, v in delta_c.items()},
        }
        return TrainResult(trained, result.loss, result.samples_seen, upload=upload)

    def client_message(self, client_id: int, result: TrainResult, round_: int) -> Params:
        """Δy_i and Δc_i; the client keeps c_i⁺ = c_i + Δc_i (Alg. 1 line 14), now that its training succeeded
        (a failed client's c_i stays as it was)."""
        upload = result.upload
        own = self.client_control(client_id)
        self.store.set(client_id, CLIENT_CONTROL, {k: v + upload[CONTROL + k] for k, v in own.items()})
        return upload

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        uploads = list(messages.values())
        deltas = [{k: m[DELTA + k] for k in self.global_params} for m in uploads]
        control_deltas = [{k: m[CONTROL + k] for k in self.server_c} for m in uploads]
        self.global_params, self.server_c = server_update(
            self.global_params,
            self.server_c,
            deltas,
            control_deltas,
            len(self.context.data.clients),
            self.config.server_lr,
        )
