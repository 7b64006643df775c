r"""CFL (Sattler, Müller and Samek, "Clustered Federated Learning: Model-Agnostic Distributed Multitask Optimization
Under Privacy Constraints", IEEE TNNLS 2021): clusters of clients found by splitting, one model per cluster.

The server keeps a set of clusters :math:`\mathcal C`, each with its model :math:`\theta_c`, from one cluster of all
clients and the run's initial model (Alg. 1, init). Every round, a client of cluster c trains from
:math:`\theta_c` and uploads its weight update :math:`\Delta\theta_i = \mathrm{SGD}_n(\theta_c, D_i) - \theta_c`
(Alg. 1, the clients' loop: :meth:`CFL.local_train`). For each cluster (:meth:`CFL.aggregate`):

* its update :math:`\Delta\theta_c = \sum_{i \in c} |D_i| \Delta\theta_i / \sum_{i \in c} |D_i|` (Alg. 1, the
  clusters' updates);
* if :math:`\lVert \Delta\theta_c \rVert < \varepsilon_1` and :math:`\max_{i \in c} \lVert \Delta\theta_i \rVert
  > \varepsilon_2` (FL has come near a stationary point of the cluster's joint objective that some client does not
  share; :func:`update_norms`), the cosine similarities :math:`\alpha_{i,j} = \langle \Delta\theta_i,
  \Delta\theta_j \rangle / (\lVert \Delta\theta_i \rVert \lVert \Delta\theta_j \rVert)`
  (:func:`cosine_similarities`) bipartition it into :math:`c_1, c_2` (:func:`bipartition`), and it is split if
  :math:`\gamma_{\max} < \sqrt{(1 - \alpha^{cross}_{\max})/2}`, :math:`\alpha^{cross}_{\max} = \max_{i \in c_1,
  j \in c_2} \alpha_{i,j}` (the separation criterion of the paper's Corollary; :func:`splits`);
* each resulting cluster's model moves by the weighted mean of its own clients' updates:
  :math:`\theta_c \leftarrow \theta_c + \Delta\theta_c` (a split cluster's two halves both from :math:`\theta_c`).

The bipartition is single-linkage hierarchical clustering of the distances :math:`1 - \alpha_{i,j}` cut into two
(``method.linkage=single``): merging the most similar clients first until two clusters remain, the paper's
Alg. 2, which gives the exact :math:`\arg\min_{c_1 \cup c_2 = c} \max_{i \in c_1, j \in c_2} \alpha_{i,j}`; the
authors' code (github.com/felisat/clustered-federated-learning) uses complete linkage instead
(``method.linkage=complete``). Both are scipy's. The defaults are the authors' code's: ε1 = 0.4, ε2 = 1.6, no split
before round 21 (``method.warmup_rounds=20``) and none of a cluster of 2 clients (``method.min_cluster_size=3``).
The paper takes γ_max ∈ [0, 1] as an input and gives no value; its code has no γ test, which is
``method.gamma_max=0`` (the default: a split is refused only when the halves' updates point the same way). ε1 and
ε2 are norms of updates in parameter space: they depend on the model, learning rate and local epochs, and the
authors' values are for their setting (EMNIST, their ConvNet); ``tables/cluster_updates.csv`` logs the norms each
round to choose them by. Neither the paper nor the code waits some rounds between splits: a new cluster may be split
again the round after.

A client's personalized (evaluated) model is its cluster's model. Each client receives its cluster's model and
uploads its update (the trained model minus the received one; integer buffers such as BatchNorm's counter as
trained). ``tables/cluster_assignments.csv`` records every client's cluster each round (the table and heatmap IFCA
writes, :mod:`plfl.methods.clusters`); ``tables/cluster_updates.csv`` each cluster's update norms, the cross
similarity of its bipartition when it was tested and whether it split; the metric ``clusters`` counts the clusters.

Departures from the paper or its code: the norms and similarities are over the model's parameters
(``named_parameters``, as the authors' code flattens them), not its buffers; the clusters' updates move every
floating-point tensor. The mean update of the ε1 test and the aggregation are sample-size weighted, as the paper's;
``method.update_weights=equal`` takes the authors' code's plain means (and FL-bench's). The code decays each
client's learning rate by 0.99 a round; plfl keeps ``federation.lr``. A split cluster keeps its index for the half
holding its lowest client id and the other half takes the next free index; the authors' code takes a split's
positions within the cluster for client ids, which is right only for the first split. A cluster is tested for a
split only in a round in which all its clients uploaded (``federation.join_ratio`` < 1 or dropped clients postpone
it): the bipartition needs every client's update. The paper places a new client by descending the tree of splits
with its update; plfl has no model for a client that never took part (``federation.unseen_clients`` is refused). CFL
takes no ``method.ala``: its similarities are of updates from the cluster's model, which ALA's local initialisation
would offset per client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from scipy.cluster.hierarchy import linkage as hierarchical_linkage
from scipy.cluster.hierarchy import to_tree
from scipy.spatial.distance import squareform

from plfl.fields import checked, one_of
from plfl.methods.base import FederationContext, Method, MethodConfig
from plfl.methods.clusters import ASSIGNMENTS_HEATMAP, assignments_table
from plfl.plots import Panel, Panels
from plfl.robust import weighted_average
from plfl.state import Params
from plfl.tasks import TrainResult, Work


@dataclass
class CFLConfig(MethodConfig):
    """CFL's keys (Sattler et al., IEEE TNNLS 2021); the defaults are the authors' code's."""

    eps1: float = checked(
        0.4,
        lambda v: v > 0,
        "a number > 0",
        "ε1: a cluster may split only when the norm of its weighted mean update is below this (near stationary; "
        "the authors' code's 0.4)",
    )
    eps2: float = checked(
        1.6,
        lambda v: v >= 0,
        "a number >= 0",
        "ε2: a cluster may split only when some client's update norm is above this (a client its model does not "
        "fit; the authors' code's 1.6, for their EMNIST ConvNet)",
    )
    gamma_max: float = checked(
        0.0,
        lambda v: 0 <= v <= 1,
        "a number in [0, 1]",
        "γ_max: a split is made only if γ_max < sqrt((1 − α_cross_max) / 2); 0: the authors' code, no test",
    )
    linkage: str = one_of(
        "single",
        ("single", "complete"),
        "the bipartition: single linkage is the paper's Alg. 2 (exact min of the max cross similarity), "
        "complete the authors' code's",
    )
    warmup_rounds: int = checked(
        20, lambda v: v >= 0, "an integer >= 0", "no cluster is split in rounds up to this one (the code's 20)"
    )
    min_cluster_size: int = checked(
        3, lambda v: v >= 2, "an integer >= 2", "only clusters of at least this many clients are split (the code's 3)"
    )
    update_weights: str = one_of(
        "samples",
        ("samples", "equal"),
        "the weights of a cluster's updates in its mean (ε1 test and aggregation): the clients' training samples, as "
        "the paper, or equal, as the authors' code",
    )


def flat_parameters(update: Params, keys: tuple[str, ...]) -> torch.Tensor:
    """The tensors ``keys`` of ``update`` flattened and joined into one float64 vector, (P,)."""
    return torch.cat([update[k].detach().reshape(-1).to(torch.float64) for k in keys])


def update_norms(updates: torch.Tensor, weights: list[float]) -> tuple[float, float]:
    """(‖Σ_i w_i Δθ_i / Σ_i w_i‖, max_i ‖Δθ_i‖) of the flat updates ``updates`` (n, P): Alg. 1's ε1 and ε2 tests
    compare them."""
    w = torch.tensor(weights, dtype=updates.dtype)
    mean = (w[:, None] * updates).sum(0) / w.sum()
    return float(mean.norm()), float(updates.norm(dim=1).max())


def cosine_similarities(updates: torch.Tensor) -> np.ndarray:
    """α_ij = ⟨Δθ_i, Δθ_j⟩ / (‖Δθ_i‖ ‖Δθ_j‖) of the flat updates ``updates`` (n, P) → (n, n) float64, in [−1, 1];
    0 for a zero update (as the authors' code's ε in the denominator makes it)."""
    norms = updates.norm(dim=1)
    unit = updates / torch.where(norms > 0, norms, torch.ones_like(norms))[:, None]
    return (unit @ unit.T).clamp(-1.0, 1.0).numpy()


def bipartition(similarities: np.ndarray, linkage: str = "single") -> tuple[list[int], list[int]]:
    """The two clusters of hierarchical clustering of the distances 1 − α (α: (n, n), n >= 2) stopped at two: with
    ``single`` linkage the paper's Alg. 2, the exact argmin over bipartitions of the largest cross similarity; with
    ``complete`` the authors' code's. Each half sorted; the one holding index 0 first.

    Raises:
        ValueError: fewer than 2 rows, or a matrix that is not square.
    """
    n = similarities.shape[0]
    if n < 2 or similarities.shape != (n, n):
        raise ValueError(f"a bipartition needs a square similarity matrix of >= 2 rows, got {similarities.shape}")
    distances = 1.0 - (similarities + similarities.T) / 2
    np.fill_diagonal(distances, 0.0)
    root = to_tree(hierarchical_linkage(squareform(distances.clip(min=0.0), checks=False), method=linkage))
    halves = sorted(sorted(side.pre_order()) for side in (root.get_left(), root.get_right()))
    return halves[0], halves[1]


def cross_similarity(similarities: np.ndarray, first: list[int], second: list[int]) -> float:
    """α_cross_max = max_{i ∈ first, j ∈ second} α_ij."""
    return float(similarities[np.ix_(first, second)].max())


def splits(gamma_max: float, cross: float) -> bool:
    """The separation criterion γ_max < √((1 − α_cross_max) / 2) (Alg. 1; the paper's Corollary)."""
    return gamma_max < math.sqrt(max(0.0, (1.0 - cross) / 2))


class CFL(Method):
    """CFL (Sattler et al., IEEE TNNLS 2021): clusters split by the cosine similarity of the clients' updates.

    From one cluster of all clients, a cluster whose FL has converged (small mean update) while some client's update
    is large is split in two; each cluster's model averages its own clients' updates.
    """

    name = "cfl"
    not_averaging = "splits clusters by the norms of the clients' updates and averages updates within each"
    config_class = CFLConfig
    server_state = ("models", "clusters")
    # Splits from the first round on, down to clusters of one client (every round tests and splits on 5 clients).
    matrix_options = {
        "method.warmup_rounds": 0,
        "method.eps1": 1000.0,
        "method.eps2": 0.0,
        "method.min_cluster_size": 2,
    }
    figures = (ASSIGNMENTS_HEATMAP, Panels("CFL clusters", (Panel("clusters", "clusters"),)))

    def __init__(self, config: CFLConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        self.parameter_names = tuple(name for name, _ in context.architecture.named_parameters())
        self.models: Params = {k: v[None].clone() for k, v in initial_params.items()}  # name → (K, *shape)
        self.clusters: list[list[int]] = [list(range(len(context.data.clients)))]
        self.global_params = self.models  # what the loop checks for NaN: every cluster's model
        self.update_rows: list[dict[str, Any]] = []  # the last aggregation's cluster_updates rows
        self.update_round = -1

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.global_params = self.models

    def cluster_of(self, client_id: int) -> int:
        """The index of the client's cluster."""
        return next(c for c, members in enumerate(self.clusters) if client_id in members)

    def cluster_model(self, cluster: int) -> Params:
        """Cluster ``cluster``'s model θ_c: copies, not views that would carry every cluster's storage along."""
        return {k: v[cluster].clone() for k, v in self.models.items()}

    def server_message(self, client_id: int, round_: int) -> Params:
        """The model of the client's cluster."""
        return self.cluster_model(self.cluster_of(client_id))

    def local_train(self, client_id: int, params: Params, message: Optional[Params], round_: int) -> Work[TrainResult]:
        """Local training from the cluster's model θ_c (``params``), uploading Δθ_i = SGD_n(θ_c) − θ_c (Alg. 1);
        integer buffers are uploaded as trained."""
        result = yield from super().local_train(client_id, params, message, round_)
        upload = {k: v - params[k] if v.is_floating_point() else v for k, v in result.params.items()}
        return TrainResult(result.params, result.loss, result.samples_seen, upload=upload)

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """Alg. 1's server: each cluster tested for a split on this round's updates, then every cluster's model
        moved by the weighted mean of its clients' updates (a split cluster's halves each by their own)."""
        config = self.config
        clusters = [list(c) for c in self.clusters]
        moved: dict[int, list[int]] = {}  # cluster index → the clients whose updates move its model
        parents: list[int] = []  # the split cluster of each cluster this round adds: the new one starts from its model
        self.update_rows, self.update_round = [], round_
        for c, members in enumerate(self.clusters):
            uploads = [i for i in members if i in messages]
            if not uploads:
                continue
            weights = self.update_weights(uploads)
            flat = torch.stack([flat_parameters(messages[i], self.parameter_names) for i in uploads])
            mean_norm, max_norm = update_norms(flat, weights)
            row = {"cluster": c, "clients": len(members), "uploads": len(uploads)}
            row.update(mean_update_norm=mean_norm, max_update_norm=max_norm, cross_similarity=None, split=0)
            moved[c] = uploads
            tested = (
                round_ > config.warmup_rounds
                and len(members) >= config.min_cluster_size
                and len(uploads) == len(members)
                and mean_norm < config.eps1
                and max_norm > config.eps2
            )
            if tested:
                similarities = cosine_similarities(flat)
                first, second = bipartition(similarities, config.linkage)
                row["cross_similarity"] = cross = cross_similarity(similarities, first, second)
                if splits(config.gamma_max, cross):
                    row["split"] = 1
                    clusters[c] = [uploads[j] for j in first]
                    clusters.append([uploads[j] for j in second])
                    moved[c] = clusters[c]
                    moved[len(clusters) - 1] = clusters[-1]
                    parents.append(c)
            self.update_rows.append(row)
        index = torch.tensor(parents, dtype=torch.long)
        models = {k: torch.cat([v, v[index]]) for k, v in self.models.items()}  # new tensors, θ_c for each half
        for c, uploads in moved.items():
            mean = weighted_average([messages[i] for i in uploads], self.update_weights(uploads))
            for k, v in mean.items():
                models[k][c] = models[k][c] + v if v.is_floating_point() else v
        self.models, self.clusters = models, clusters
        self.global_params = self.models

    def update_weights(self, clients: list[int]) -> list[float]:
        """The weights of ``clients``' updates in their cluster's mean (``method.update_weights``), unnormalised."""
        if self.config.update_weights == "equal":
            return [1.0] * len(clients)
        return [float(self.context.data.clients[i].num_train) for i in clients]

    def new_client_model(self, round_: int) -> Optional[Params]:
        """None: the paper places a new client by its update down the tree of splits, which plfl does not keep."""
        return None

    def round_metrics(self, round_: int) -> dict[str, float]:
        """``clusters``: the number of clusters after this round's splits."""
        return {"clusters": len(self.clusters)}

    def round_tables(self, round_: int) -> dict[str, list[dict[str, Any]]]:
        """``cluster_assignments`` (a row per client: its cluster, a 0/1 column ``c<j>`` per cluster) and, in a
        round with uploads, ``cluster_updates`` (a row per cluster before the round's splits: its clients, uploads,
        weighted mean and max update norms, the bipartition's α_cross_max when tested, and whether it split)."""
        tables = assignments_table(self.assignments(), len(self.clusters))
        if self.update_round == round_:
            tables["cluster_updates"] = self.update_rows
        return tables

    def assignments(self) -> list[int]:
        """Every client's cluster index."""
        owner = {i: c for c, members in enumerate(self.clusters) for i in members}
        return [owner[i] for i in range(len(self.context.data.clients))]
