r"""kNN-Per (Marfoq, Neglia, Vidal and Kameni, "Personalized Federated Learning through Local Memorization", ICML 2022,
arXiv:2111.09360): the global model of FedAvg, interpolated at each client with a k-nearest-neighbours model over the
client's own training samples in the global model's representation space.

The model is a body φ (the representation, ``body.*``) and a linear head h (``head.*``). Alg. 1 ("typical usage"):
the global model is learnt by FedAvg; each client m builds a datastore S_m of pairs (φ(x_i), y_i) over its training
samples and predicts (the paper's Eq. 7)

    p_m(y | x) = λ_m · p_kNN(y | x) + (1 − λ_m) · softmax(h(φ(x)))_y,

    p_kNN(y | x) = Σ_{i ∈ N_k(x)} w_i 1{y_i = y},   w_i = exp(−‖φ(x) − φ(x_i)‖² / (F σ)) / Σ_{j ∈ N_k(x)} exp(−‖φ(x) −
    φ(x_j)‖² / (F σ)),

N_k(x) the k datastore entries nearest to φ(x) in squared Euclidean distance, F the representation's dimension
(:func:`knn_probabilities`, :func:`interpolate`; k = ``method.neighbours``, σ = ``method.scale``, λ_m =
``method.weight``). The normalised Gaussian kernel and its scale F σ are those of the authors' code (client.py,
``gather_knn_outputs``; FAISS's IndexFlatL2 returns squared distances); plfl computes it as a softmax over the k
neighbours of −d²/(Fσ), the same weights without the underflow to 0/0 that a far query gives the plain quotient.

Each round (``federation.*``: FedAvg's): the sampled clients train the global model as FedAvg's clients do
(``local_train``, from the received model without the datastore) and upload it; the server takes FedAvg's
sample-weighted mean (``aggregate``). At the broadcast every client (``pre_local_init``) receives the global model,
computes the features of its datastore samples with the received body (a :class:`~plfl.tasks.FeatureTask`), and
keeps them with their labels beside the model, never sent; the evaluated prediction is Eq. 7 (:class:`KNNPerForward`
through :meth:`KNNPer.prediction`). With validation splits (``data.val_fraction`` > 0) and a non-empty
``method.weight_grid``, each client picks λ_m from the grid by its accuracy on its own validation split (the first
best in the grid's order): the paper holds 20 % of each local dataset out for validation and tunes there; without
validation splits every client takes ``method.weight``. ``method.capacity`` keeps that fraction of a client's training
samples in its datastore (⌊capacity · n_m⌋, at least one), drawn once per client from the stream "knnper_datastore",
for the paper's accuracy-against-capacity figures.

Messages are FedAvg's, both ways: the datastore never leaves its client. ``global_accuracy`` is the global model alone
(λ = 0); ``knn_accuracy`` the kNN model alone (λ = 1) on the clients' test splits, pooled; ``knnper_weight`` the mean
λ_m; ``tables/knnper_clients.csv`` each client's λ_m, datastore size, kNN accuracy and validation accuracy. λ = 0
is FedAvg: the same global models, messages and accuracies (the prediction is then the model's logits themselves;
their loss is summed over other batches, equal to rounding).

Departures from the paper and the authors' code: the datastore is rebuilt from the global model at every round's
broadcast, so that every round is evaluated (the paper builds it once, from the final FedAvg model); exact search
(``torch.topk`` over all distances) in place of FAISS's, the same neighbours up to ties; λ_m is tuned on the
validation split when there is one, from a grid (default 0, 0.1, ..., 1; the authors' code reports the test accuracy
over a grid of λ and capacities); the kNN-only accuracy needs the test split's evaluation at λ = 1, done in
``pre_local_init`` and reported only. The authors' code, and FL-bench's (src/client/knnper.py), interpolate the kNN
probabilities with the model's *logits* (``--interpolate_logits``); plfl follows Eq. 7's probabilities unless
``method.interpolate=logits``. The evaluated "logits" of Eq. 7 are log p_m, floored at the smallest normal float
(a class with p_m = 0 at λ = 1 gets a finite loss). Defaults: k = 7, the authors' CIFAR scripts' (FL-bench: 5);
σ = 1 (both); λ = 0.5 (FL-bench) where it is not tuned; capacity 1, the whole training split (FL-bench: 500 samples,
and its capacity check counts batches, not samples). The datastore's features are the
:class:`~plfl.tasks.FeatureTask`'s, in training mode: with BatchNorm in the body they are normalised by their batch's
statistics, while the evaluated samples' are normalised by the running statistics (the models of FedALA's setting
have no BatchNorm). Clients that never took part (``federation.unseen_clients``) are evaluated with the global model
alone: plfl evaluates them by the architecture's forward pass. ALA (``method.ala``) is not offered: the datastore
indexes the received body's representation, and the paper serves the global model as it is; an adapted local model
would leave the two apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from plfl.fields import checked, one_of
from plfl.methods.base import FederationContext, MethodConfig, require_linear_head
from plfl.methods.fedavg import FedAvg
from plfl.seeding import derive_seed
from plfl.state import Params
from plfl.tasks import EvalResult, EvalTask, FeatureResult, FeatureTask, Forward, Network, TrainResult, Work

KEYS = "knnper/keys"  # the datastore's features φ(x_i), (N, F), padded with zeros to the run's largest datastore
LABELS = "knnper/labels"  # their labels y_i, (N,) int64, 0 where padded
PRESENT = "knnper/present"  # 1 for an entry of the datastore, 0 for padding, (N,) float
WEIGHT = "knnper/weight"  # λ_m, a 0-dim float tensor
OWN = (KEYS, LABELS, PRESENT, WEIGHT)
STATISTICS = "knnper"  # the store's key of a client's λ_m, datastore size and accuracies (round_metrics)


@dataclass
class KNNPerConfig(MethodConfig):
    """kNN-Per's keys (Marfoq et al., ICML 2022). The global model is served as it is, so there is no
    ``method.ala``."""

    neighbours: int = checked(
        7, lambda v: v >= 1, "an integer >= 1", "k: datastore entries the kNN model reads (the authors' scripts: 7)"
    )
    scale: float = checked(
        1.0,
        lambda v: v > 0,
        "a number > 0",
        "σ: the kernel exp(−d²/(F σ)) of the squared distance d² in F feature dimensions (the authors' 1)",
    )
    weight: float = checked(
        0.5,
        lambda v: 0 <= v <= 1,
        "a number in [0, 1]",
        "λ: weight of the kNN model when it is not tuned on a validation split (0 is FedAvg; FL-bench's 0.5)",
    )
    weight_grid: list[float] = field(
        default_factory=lambda: [i / 10 for i in range(11)],
        metadata={
            "check": lambda v: all(0 <= w <= 1 for w in v),
            "allowed": "a list of numbers in [0, 1]",
            "doc": "the λ each client tries on its validation split (data.val_fraction > 0), keeping the best; "
            "[]: method.weight",
        },
    )
    capacity: float = checked(
        1.0,
        lambda v: 0 < v <= 1,
        "a number in (0, 1]",
        "fraction of a client's training samples kept in its datastore (at least one)",
    )
    interpolate: str = one_of(
        "probabilities",
        ("probabilities", "logits"),
        "what the kNN probabilities mix with: probabilities, the model's softmax (Eq. 7); logits, the model's "
        "logits (the authors' code and FL-bench's)",
    )


def squared_distances(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """‖q_a − k_b‖² for queries (W, F) and keys (N, F): (W, N), as ‖q‖² + ‖k‖² − 2 q·k (FAISS's flat L2 index
    computes it so), floored at 0."""
    cross = queries @ keys.transpose(-1, -2)
    return (queries.square().sum(-1, keepdim=True) + keys.square().sum(-1).unsqueeze(-2) - 2 * cross).clamp_min(0)


def knn_probabilities(
    features: torch.Tensor,
    keys: torch.Tensor,
    labels: torch.Tensor,
    present: torch.Tensor,
    neighbours: int,
    scale: float,
    num_classes: int,
) -> torch.Tensor:
    """p_kNN(y | x) (the module docstring), (W, num_classes), for the features (W, F) of W queries and a datastore of
    keys (N, F), labels (N,) int64 and ``present`` (N,) 1/0 (0: padding, never a neighbour); the k = min(neighbours,
    N) nearest entries weigh softmax(−d²/(F σ)) over the k. The datastore must hold one entry at least."""
    k = min(neighbours, keys.shape[-2])
    distances = squared_distances(features, keys).masked_fill(present.unsqueeze(-2) == 0, math.inf)
    negated, nearest = torch.topk(-distances, k, dim=-1)
    weights = torch.softmax(negated / (features.shape[-1] * scale), dim=-1)  # (W, k); padding: 0
    neighbour_labels = torch.gather(labels.unsqueeze(-2).expand(nearest.shape[0], -1), -1, nearest)
    classes = torch.arange(num_classes, device=labels.device)
    votes = (neighbour_labels.unsqueeze(-1) == classes).to(weights.dtype)  # (W, k, C)
    return (weights.unsqueeze(-1) * votes).sum(-2)


def interpolate(logits: torch.Tensor, knn: torch.Tensor, weight: torch.Tensor, mode: str) -> torch.Tensor:
    """Eq. 7's prediction as logits (W, C) from the model's ``logits`` (W, C), the kNN probabilities ``knn`` (W, C)
    and λ = ``weight`` (0-dim): log(λ p_kNN + (1 − λ) softmax(logits)), floored at log of the smallest normal float
    (``mode`` "probabilities"), or λ p_kNN + (1 − λ) logits ("logits"); λ = 0 returns ``logits`` themselves."""
    if mode == "logits":
        mixed = weight * knn + (1 - weight) * logits
    else:
        p = weight * knn + (1 - weight) * torch.softmax(logits, dim=-1)
        mixed = torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))
    return torch.where(weight > 0, mixed, logits)


@dataclass(frozen=True)
class KNNPerForward(Forward):
    """A kNN-Per client's prediction (Eq. 7, :func:`interpolate`) from its model: the body's features, the head's
    logits, and the kNN model over the datastore in ``knnper/keys``, ``knnper/labels``, ``knnper/present`` with
    λ = ``knnper/weight``."""

    work = "kNN-Per's prediction"
    neighbours: int
    scale: float
    mode: str

    def __call__(self, network: Network, params: Params, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        features, _ = network(params, x, None, "body")
        logits, _ = network(params, features, None, "head")
        knn = knn_probabilities(
            features, params[KEYS], params[LABELS], params[PRESENT], self.neighbours, self.scale, logits.shape[-1]
        )
        return interpolate(logits, knn, params[WEIGHT], self.mode)


def padded_datastore(features: FeatureResult, size: int) -> Params:
    """The datastore tensors (:data:`KEYS`, :data:`LABELS`, :data:`PRESENT`) of ``features`` (x (m, F), y (m,)),
    padded to ``size`` ≥ m entries, so that every client's tensors have the same shapes (the vectorized executor
    stacks them)."""
    m, dim = features.x.shape
    keys = torch.zeros(size, dim, dtype=features.x.dtype)
    labels = torch.zeros(size, dtype=torch.int64)
    present = torch.zeros(size, dtype=features.x.dtype)
    keys[:m], labels[:m], present[:m] = features.x, features.y, 1
    return {KEYS: keys, LABELS: labels, PRESENT: present}


def best_weight(grid: list[float], results: list[EvalResult]) -> float:
    """The λ of ``grid`` whose validation result has the most correct predictions, the first such in the grid."""
    best = max(range(len(grid)), key=lambda i: (results[i].correct, -i))
    return grid[best]


class KNNPer(FedAvg):
    """kNN-Per (Marfoq et al., ICML 2022): the FedAvg model interpolated with a kNN model over each client's data.

    Each client keeps its training samples' features under the global body, never sent, and mixes their vote in.
    """

    name = "knnper"
    config_class = KNNPerConfig
    # Validation splits (λ tuned per client from a two-point grid) and a datastore of 60 % of each client's samples.
    matrix_options = {"data.val_fraction": 0.2, "method.weight_grid": "[0.0,0.5]", "method.capacity": 0.6}

    def __init__(self, config: KNNPerConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_linear_head("knnper", context, "mixes the head's prediction with a kNN model over the body's features")
        self.architecture_keys = tuple(initial_params)
        self.forward = KNNPerForward(config.neighbours, config.scale, config.interpolate)
        sizes = [self.datastore_size(c.num_train) for c in context.data.clients]
        self.capacity_max = max(sizes, default=1)  # every client's datastore is padded to it
        self.tuned = context.data.has_validation and bool(config.weight_grid)

    def datastore_size(self, n: int) -> int:
        """⌊capacity · n⌋ of a client's n training samples, at least one."""
        return max(1, math.floor(self.config.capacity * n))

    def datastore_samples(self, client_id: int) -> torch.Tensor:
        """The client's datastore samples, (m,) int64 indices into its training split in increasing order: all of
        them, or ⌊capacity · n⌋ drawn once from the stream "knnper_datastore"."""
        n = self.context.data.clients[client_id].num_train
        m = self.datastore_size(n)
        if m >= n:
            return torch.arange(n)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, 0, client_id, "knnper_datastore"))
        return torch.randperm(n, generator=generator)[:m].sort().values

    def prediction(self) -> KNNPerForward:
        return self.forward

    def global_model(self, round_: int) -> Params:
        """The FedAvg model alone (λ = 0), on every client's test split: ``global_accuracy``."""
        return self.global_params

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Work[Params]:
        """The received global model with the client's datastore (its samples' features under the received body)
        and λ_m: tuned on its validation split, or ``method.weight`` (0 for an empty datastore). The kNN model alone
        is scored on the test split for ``knn_accuracy``."""
        model = dict(message)
        features: FeatureResult = yield FeatureTask(
            client_id, model, self.datastore_samples(client_id), self.context.federation.batch_size
        )
        base = {**model, **padded_datastore(features, self.capacity_max)}
        if not len(features.y):  # no sample left (BatchNorm leaves a lone sample out): the global model alone
            empty = {"weight": 0.0, "datastore": 0, "knn_correct": 0, "knn_total": 0, "val_accuracy": math.nan}
            self.store.set(client_id, STATISTICS, empty)
            return {**base, WEIGHT: torch.tensor(0.0)}
        grid = list(self.config.weight_grid) if self.tuned else []
        tasks = [EvalTask(client_id, {**base, WEIGHT: torch.tensor(1.0)}, forward=self.forward)]
        tasks += [
            EvalTask(client_id, {**base, WEIGHT: torch.tensor(float(w))}, split="val", forward=self.forward)
            for w in grid
        ]
        results = yield tasks
        knn, validation = results[0], results[1:]
        weight = best_weight(grid, validation) if grid else self.config.weight
        chosen = validation[grid.index(weight)].accuracy if grid else math.nan
        self.store.set(
            client_id,
            STATISTICS,
            {
                "weight": float(weight),
                "datastore": len(features.y),
                "knn_correct": knn.correct,
                "knn_total": knn.total,
                "val_accuracy": chosen,
            },
        )
        return {**base, WEIGHT: torch.tensor(float(weight))}

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """FedAvg's local training of the client's model without its datastore."""
        model = {k: params[k] for k in self.architecture_keys}
        return (yield from super().local_train(client_id, model, message, round_))

    def statistics(self) -> list[dict[str, Any]]:
        """Every client's statistics of the last broadcast (those that have some)."""
        rows = [(i, self.store.get(i, STATISTICS)) for i in range(len(self.store))]
        return [{"client": i, **s} for i, s in rows if s is not None]

    def round_metrics(self, round_: int) -> dict[str, float]:
        """``knnper_weight``: the mean λ_m; ``knn_accuracy``: the kNN model alone on the clients' test splits, pooled;
        ``knnper_datastore``: the mean datastore size."""
        rows = self.statistics()
        if not rows:
            return {}
        total = sum(r["knn_total"] for r in rows)
        return {
            "knnper_weight": sum(r["weight"] for r in rows) / len(rows),
            "knn_accuracy": sum(r["knn_correct"] for r in rows) / total if total else math.nan,
            "knnper_datastore": sum(r["datastore"] for r in rows) / len(rows),
        }

    def round_tables(self, round_: int) -> dict[str, list[dict[str, Any]]]:
        """``knnper_clients``: per client its λ_m, datastore size, kNN-alone test accuracy and validation accuracy at
        λ_m (NaN when λ is not tuned)."""
        rows = [
            {
                "round": round_,
                "client": r["client"],
                "weight": r["weight"],
                "datastore": r["datastore"],
                "knn_accuracy": r["knn_correct"] / r["knn_total"] if r["knn_total"] else math.nan,
                "val_accuracy": r["val_accuracy"],
            }
            for r in self.statistics()
        ]
        return {"knnper_clients": rows} if rows else {}
