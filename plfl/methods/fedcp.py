r"""FedCP (Zhang, Hua, Wang, Song, Xue, Ma and Guan, "FedCP: Separating Feature Information for Personalized
Federated Learning via Conditional Policy", KDD 2023, arXiv:2307.01217): a conditional policy network splits each
sample's features, per dimension, between a global head and a personalized head.

Client i's model is the feature extractor f (the architecture's body, ``body.*``), its personalized head
h^p_i (the architecture's head, ``head.*``), a copy of the global head h^g (``fedcp/global_head.*``), the
Conditional Policy Network (CPN; ``fedcp/cpn.*``) and its conditional input v_i (``fedcp/context``). For a sample
x with features z = f(x) of F dimensions (:func:`fedcp_logits`):

- the CPN input is z ⊙ v̂_i, v̂_i = v_i / ‖v_i‖₂ (the client-specific condition);
- the CPN: a = ReLU(LayerNorm(W a_in + b)), W (2F × F), split into a_p = a[:F] and a_g = a[F:]
  (:func:`policy_logits`);
- the policy: (r, s) = softmax((a_p + g_p, a_g + g_g)/τ) elementwise over the two parts, g Gumbel noise
  (the Gumbel-softmax, not hard; :func:`policy`), so r + s = 1 in every dimension (τ = ``method.tau``);
- the output: h^p_i(z ⊙ r) + h^g(z ⊙ s).

Local training (``local_train``, the step task :class:`FedCPStep`): ``federation.local_epochs`` epochs of plain
SGD at ``federation.lr`` on CE + λ MMD²(f(x), f^g(x)) per mini-batch, f^g the feature extractor received at the
last broadcast (frozen), MMD² the biased estimate with the sum of RBF kernels exp(−‖u − w‖²/(2σ)),
σ ∈ {10, 15, 20, 50} (:func:`mmd`; λ = ``method.lam``). The trained parameters are f, h^p_i and the CPN; h^g stays
frozen. After training the client uploads (``client_message``) f, the CPN and ½ h^p_i + ½ h^g (the head it
offers the global one); the server (``aggregate``) sets each of the three to the mean of the uploads weighted by
the clients' training samples. The broadcast (``server_message``) sends the feature extractor to every client,
and the global head and the CPN to the clients that uploaded in that round (at round 0, the initial ones, to
every client); a client that receives the global head replaces its copy and sets its conditional input to the sum
over classes of its personalized head's weight rows, v_i = Σ_c W^p_{i,c} (from round 1 on; before, v_i is drawn
uniformly in [0, 1)^F). ``pre_local_init`` builds the client's model from the message over the one it holds.
The evaluated model is this ensemble (:class:`FedCPForward`, through :meth:`FedCP.prediction`), with Gumbel noise
drawn at evaluation too, as PFLlib tests (``method.evaluation=gumbel``), or without (``softmax``).

Gumbel noise is a pure function of (seed, round, client, step, row of the batch, dimension) for training and
(seed, round, client, sample's index in the evaluated split, dimension) for evaluation, through an integer hash
(:func:`gumbel_noise`), so every executor draws the same noise whatever its batching. Messages count the tensors
above: down, the feature extractor, plus the global head and the CPN where sent; up, all three.

Departures, where plfl follows PFLlib's clientcp.py/servercp.py: the conditional input is the sum of the rows of the
personalized head's weight matrix (the product of a multi-layer head's matrices in PFLlib; plfl's heads are one
linear layer); the uploaded head is the mean of the personalized and the received global head; the Gumbel noise is
drawn at evaluation as well as in training; the global head and CPN reach only the round's uploaders while the
feature extractor reaches every client (PFLlib's serverbase broadcast); λ = 1, PFLlib's default. The authors'
repository (TsingZ0/FedCP) differs in places between its versions: in one, the uploaded head's weights are W^p ⊙ r̄ +
W^g ⊙ s̄ (mixed by the policy averaged over the last epoch's samples; the bias stays W^g's) and v_i = Σ_c
``|W^up_{i,c} − W^g_c|``, from the uploaded and the new global head; its data loaders do not shuffle and drop every last
incomplete batch, the test's too; its MNIST script takes λ = 5. Departures from PFLlib: its initial conditional
input is one torch.rand draw after reseeding torch with 0 for every client, so all its clients start from the same
one, where plfl draws one per client from the run's seed; PFLlib's CPN is initialised from torch's global generator
after the model, plfl's from the stream "fedcp_cpn"; PFLlib drops each client's last incomplete batch (plfl only
with ``federation.drop_last``). Models whose head is not one ``nn.Linear`` layer are refused (ConfigError); the
global and new clients' models are not evaluated (no ``global_accuracy``, no unseen clients). The steps are plain
SGD (``federation.momentum`` must be 0) without ``data.augment``; the reported loss is the cross-entropy alone; ALA
(``method.ala``) is not offered, since the client's model is not the architecture's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad

from plfl.fields import checked, one_of
from plfl.methods.base import FederationContext, Method, MethodConfig, require_linear_head, require_plain_steps
from plfl.methods.partial import module_keys
from plfl.seeding import derive_seed
from plfl.state import Params
from plfl.tasks import (
    Batch,
    Forward,
    Network,
    Step,
    StepOutput,
    StepResult,
    TrainResult,
    Work,
    masked_cross_entropy,
    sample_count,
)

GLOBAL = "fedcp/global_"  # prefix of the global head's tensors: fedcp/global_head.weight, fedcp/global_head.bias
CPN = ("fedcp/cpn.linear.weight", "fedcp/cpn.linear.bias", "fedcp/cpn.norm.weight", "fedcp/cpn.norm.bias")
CONTEXT = "fedcp/context"  # v_i, (F,)
EVAL_SEED = "fedcp/evaluation_seed"  # 0-dim int64: the key of the evaluation's Gumbel noise
SEED, STEP = "fedcp/seed", "fedcp/step"  # a step task's noise key (input) and step counter (state), 0-dim int64
BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # σ of the MMD's RBF kernels (PFLlib's)
MASK32 = 0xFFFFFFFF


@dataclass
class FedCPConfig(MethodConfig):
    """FedCP's keys (Zhang et al., KDD 2023)."""

    lam: float = checked(
        1.0, lambda v: v >= 0, "a number >= 0", "λ: weight of the MMD between the client's and the global features"
    )
    tau: float = checked(1.0, lambda v: v > 0, "a number > 0", "τ: temperature of the policy's Gumbel-softmax")
    evaluation: str = one_of(
        "gumbel",
        ("gumbel", "softmax"),
        "the policy at evaluation: gumbel, with Gumbel noise as in training (PFLlib's test); softmax, without",
    )


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 ``x`` (its low 32 bits), elementwise; every product stays below 2^63."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & MASK32
    return x ^ (x >> 16)


def gumbel_from_bits(h: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel draws −log(−log u) from int64 hashes ``h`` in [0, 2^32), elementwise, float32: u = (k + ½)/2^23
    with k the hash's top 23 bits, uniform in (0, 1) and exact in float32 (so u < 1 and every draw is finite)."""
    u = ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return -torch.log(-torch.log(u))


def gumbel_noise(key: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    """Standard Gumbel draws (:func:`gumbel_from_bits`), (W, ``width``) float32: a pure function of the 0-dim int64
    ``key``, the (W,) int64 ``rows`` and the column, so that the same key and row give the same draws in any
    batch."""
    columns = torch.arange(width, device=rows.device)
    h = _mix(_mix(key) ^ _mix(rows + 0x3C6EF372).unsqueeze(-1))
    return gumbel_from_bits(_mix(h ^ _mix(columns + 0x1B873593)))


def fold(seed: int) -> torch.Tensor:
    """A 63-bit seed folded to 32 bits, as a 0-dim int64 tensor (:func:`gumbel_noise`'s key)."""
    return torch.tensor((seed ^ (seed >> 32)) & MASK32, dtype=torch.int64)


def policy_logits(cpn: Params, gate_input: torch.Tensor) -> torch.Tensor:
    """The CPN: ReLU(LayerNorm(W a_in + b)), (W_rows, F) → (W_rows, 2, F), [:, 0] the personalized part's and
    [:, 1] the global part's logits; ``cpn`` holds :data:`CPN`'s tensors (W (2F, F), b, γ, β (2F,))."""
    linear_w, linear_b, norm_w, norm_b = (cpn[k] for k in CPN)
    hidden = F.layer_norm(F.linear(gate_input, linear_w, linear_b), norm_w.shape, norm_w, norm_b)
    return F.relu(hidden).unflatten(-1, (2, -1))


def policy(logits: torch.Tensor, noise: Optional[torch.Tensor], tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, s), each (W, F): the softmax over the two parts of (logits + noise)/τ, ``logits`` (W, 2, F), ``noise``
    of its shape or None (no noise). r + s = 1."""
    weights = torch.softmax((logits if noise is None else logits + noise) / tau, dim=-2)
    return weights[..., 0, :], weights[..., 1, :]


def fedcp_logits(
    network: Network,
    params: Params,
    features: torch.Tensor,
    noise: Optional[torch.Tensor],
    head_keys: tuple[str, ...],
    tau: float,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """h^p(z ⊙ r) + h^g(z ⊙ s), (W, classes), for the features z (W, F), the policy from the CPN on z ⊙ v̂ with
    ``noise`` (W, 2, F) or None; ``params`` holds the personalized head (``head_keys``), the global head, the CPN
    and v."""
    condition = F.normalize(params[CONTEXT], dim=-1)
    r, s = policy(policy_logits(params, features * condition), noise, tau)
    personal, _ = network({k: params[k] for k in head_keys}, features * r, mask, "head")
    shared, _ = network({k: params[GLOBAL + k] for k in head_keys}, features * s, mask, "head")
    return personal + shared


def mmd(x: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The biased MMD² estimate of samples x and y, each (W, F): the mean over all pairs (i, j) of real samples
    (``mask`` 1; all when None) of k(x_i, x_j) + k(y_i, y_j) − 2 k(x_i, y_j), k(u, w) = Σ_σ exp(−‖u − w‖²/(2σ)),
    σ ∈ :data:`BANDWIDTHS`; a 0-dim tensor."""
    xx, yy, xy = x @ x.T, y @ y.T, x @ y.T
    nx, ny = torch.diagonal(xx), torch.diagonal(yy)
    distances = (
        nx[:, None] + nx[None, :] - 2 * xx,
        ny[:, None] + ny[None, :] - 2 * yy,
        nx[:, None] + ny[None, :] - 2 * xy,
    )
    kxx, kyy, kxy = (sum(torch.exp(-0.5 * d / sigma) for sigma in BANDWIDTHS) for d in distances)
    terms = kxx + kyy - 2 * kxy
    if mask is None:
        return terms.mean()
    return (terms * mask[:, None] * mask[None, :]).sum() / mask.sum().square()


@dataclass(frozen=True)
class FedCPForward(Forward):
    """A FedCP client's prediction (:func:`fedcp_logits`) from its model, with the evaluation's Gumbel noise
    (keyed by ``fedcp/evaluation_seed`` and the samples' indices) when ``noise``."""

    work = "FedCP's prediction"
    head_keys: tuple[str, ...]
    tau: float
    noise: bool

    def __call__(self, network: Network, params: Params, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        features, _ = network(params, x, None, "body")
        noise = None
        if self.noise:
            width = params[CONTEXT].shape[-1]
            noise = gumbel_noise(params[EVAL_SEED], rows, 2 * width).unflatten(-1, (2, width))
        return fedcp_logits(network, params, features, noise, self.head_keys, self.tau)


@dataclass(frozen=True)
class FedCPStep(Step):
    """One SGD step of the feature extractor, the personalized head and the CPN on CE + λ MMD² on a mini-batch.
    State: the architecture's tensors, the CPN's and ``fedcp/step``; inputs: the global head, v and ``fedcp/seed``;
    shared: the received feature extractor. The loss returned is the cross-entropy."""

    work = "FedCP's local steps"
    parameters: tuple[str, ...]  # the architecture's parameters: feature extractor and personalized head
    head_keys: tuple[str, ...]
    lam: float
    tau: float
    lr: float

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        trained = self.parameters + CPN
        width = inputs[CONTEXT].shape[-1]
        rows = torch.arange(batch.x.shape[0], device=batch.x.device)
        key = _mix(inputs[SEED] ^ _mix(state[STEP] + 0x2545F491))
        noise = gumbel_noise(key, rows, 2 * width).unflatten(-1, (2, width))
        global_features, _ = network(shared, batch.x, batch.mask, "body")
        buffers = {k: v for k, v in state.items() if k not in trained and k != STEP}

        def loss(w: Params) -> tuple[torch.Tensor, tuple[torch.Tensor, Params]]:
            model = {**buffers, **w}
            features, statistics = network(model, batch.x, batch.mask, "body")
            logits = fedcp_logits(network, {**model, **inputs}, features, noise, self.head_keys, self.tau, batch.mask)
            cross_entropy = masked_cross_entropy(logits, batch.y, batch.mask)
            discrepancy = mmd(features, global_features.detach(), batch.mask)
            return cross_entropy + self.lam * discrepancy, (cross_entropy, statistics)

        w = {k: state[k] for k in trained}
        grads, (cross_entropy, statistics) = grad(loss, has_aux=True)(w)
        new = {k: v - self.lr * grads[k] for k, v in w.items()}
        return StepOutput({**buffers, **statistics, **new, STEP: state[STEP] + 1}, cross_entropy, sample_count(batch))


class FedCP(Method):
    """FedCP (Zhang et al., KDD 2023): a conditional policy splits each feature between a global and a personal head.

    Feature extractor, global head and policy network are averaged; personal heads stay; MMD aligns features.
    """

    name = "fedcp"
    not_averaging = None
    config_class = FedCPConfig
    server_state = ("global_params", "uploaders", "upload_round")
    matrix_options = {"federation.batch_size": 7}  # short last batches: padding in the vectorized steps

    def __init__(self, config: FedCPConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("fedcp", context, "the feature extractor, personalized head and policy network")
        require_linear_head("fedcp", context, "conditions its policy on the personalized head's weight rows")
        architecture = context.architecture
        head = module_keys(architecture, lambda name, _: name == "head")
        self.head_keys = tuple(k for k in initial_params if k in head)
        self.body_keys = tuple(k for k in initial_params if k not in head)
        self.parameter_names = tuple(name for name, _ in architecture.named_parameters())
        self.dim = architecture.head.in_features
        self.initial_params = initial_params
        self.global_params = {
            **{k: initial_params[k] for k in self.body_keys},
            **{GLOBAL + k: initial_params[k] for k in self.head_keys},
            **self._initial_cpn(),
        }
        self.uploaders: list[int] = []  # the clients whose uploads the last aggregation averaged
        self.upload_round = 0  # the round of that aggregation

    def _initial_cpn(self) -> Params:
        """The CPN's initial tensors: torch's default initialisation of Linear(F, 2F) and LayerNorm(2F), drawn
        from the stream "fedcp_cpn" of the run's seed."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, 0, -1, "fedcp_cpn"))
            linear, norm = nn.Linear(self.dim, 2 * self.dim), nn.LayerNorm(2 * self.dim)
        tensors = (linear.weight, linear.bias, norm.weight, norm.bias)
        return {k: t.detach().clone() for k, t in zip(CPN, tensors)}

    def initial_model(self, client_id: int) -> Params:
        """Client ``client_id``'s model before its first broadcast: the initial architecture, global head and
        CPN, and v_i uniform in [0, 1)^F from the stream "fedcp_context"."""
        generator = torch.Generator().manual_seed(derive_seed(self.seed, 0, client_id, "fedcp_context"))
        return {
            **self.initial_params,
            **{k: v for k, v in self.global_params.items() if k.startswith(GLOBAL) or k in CPN},
            CONTEXT: torch.rand(self.dim, generator=generator),
        }

    def server_message(self, client_id: int, round_: int) -> Params:
        """The global feature extractor; with the global head and the CPN for a client that uploaded in this
        round's aggregation, or for every client at round 0."""
        if round_ == 0 or (round_ == self.upload_round and client_id in self.uploaders):
            return self.global_params
        return {k: self.global_params[k] for k in self.body_keys}

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """The received tensors over the client's model; a client that received the global head (after round 0)
        sets v_i to the sum over classes of its personalized head's weight rows. The evaluation's noise key is
        the round's."""
        own = self.store.get(client_id, "model") or self.initial_model(client_id)
        model = {**own, **{k: v.clone() for k, v in message.items()}}
        if round_ > 0 and GLOBAL + self.head_keys[0] in message:
            model[CONTEXT] = own[self._head_weight].sum(0)
        model[EVAL_SEED] = fold(derive_seed(self.seed, round_, client_id, "fedcp_evaluation"))
        return model

    @property
    def _head_weight(self) -> str:
        return next(k for k in self.head_keys if k.endswith("weight"))

    def prediction(self) -> FedCPForward:
        return FedCPForward(self.head_keys, self.config.tau, self.config.evaluation == "gumbel")

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """From the client's model (``params``), the feature extractor, personalized head and CPN trained with the
        received feature extractor (``message``) as the MMD's reference; the global head's offer
        ½ h^p + ½ h^g replaces the client's copy and is uploaded with the other two."""
        architecture = tuple(self.initial_params)
        step = FedCPStep(
            self.parameter_names, self.head_keys, self.config.lam, self.config.tau, self.context.federation.lr
        )
        state = {**{k: params[k] for k in architecture + CPN}, STEP: torch.tensor(0, dtype=torch.int64)}
        inputs = {
            **{GLOBAL + k: params[GLOBAL + k] for k in self.head_keys},
            CONTEXT: params[CONTEXT],
            SEED: fold(derive_seed(self.seed, round_, client_id, "fedcp_gumbel")),
        }
        shared = {k: message[k] for k in self.body_keys}
        result: StepResult = yield self.step_task(
            client_id, step, state, round_, "local_training", inputs=inputs, shared=shared
        )
        trained = {**params, **{k: result.state[k] for k in architecture + CPN}}
        for k in self.head_keys:
            trained[GLOBAL + k] = 0.5 * trained[k] + 0.5 * params[GLOBAL + k]
        upload = {k: trained[k] for k in self.global_params}
        return TrainResult(trained, result.loss, result.samples_seen, upload=upload)

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """Feature extractor, global head and CPN ← the uploads' means weighted by the clients' training
        samples (or ``aggregation.rule``, :meth:`average`)."""
        sizes = [self.context.data.clients[i].num_train for i in messages]
        self.global_params = self.average(list(messages.values()), sizes, self.global_params, round_)
        self.uploaders, self.upload_round = sorted(messages), round_
