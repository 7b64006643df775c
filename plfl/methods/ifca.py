r"""IFCA (Ghosh, Chung, Yin and Ramchandran, NeurIPS 2020): the Iterative Federated Clustering Algorithm.

The server keeps k cluster models :math:`\theta_1, \dots, \theta_k` and sends all of them to every client. A
client estimates its cluster as the model of lowest loss on its own training data,
:math:`\hat j = \arg\min_j F_i(\theta_j)` (Alg. 1, cluster identity estimation), and trains that model; it
uploads the trained model with :math:`\hat j`. The server averages each cluster's uploads,
:math:`\theta_j \leftarrow \sum_{i \in S_j} \tilde\theta_i / |S_j|` (Alg. 1, model averaging), and keeps the model of
a cluster no client chose. The k models start from k initialisations of the architecture (the first is the run's
initial model), drawn from the run's seed. The clusters separate only from a good enough initialisation (the paper's
analysis): on rotated MNIST (``configs/ifca-mnist-rotated.yaml``) one seed in four merges two groups. The paper
relaxes this by random restarts; in plfl a restart is a run with another ``federation.seed``, and the run of lowest
training loss (``train_loss`` in metrics.csv) can be kept: the merged seed's is the highest by round 5.

A client's evaluated (personalized) model is its cluster's model, estimated at every broadcast, so every
client, sampled or not, is scored on the cluster it would join. ``tables/cluster_assignments.csv`` records each
client's cluster every round. A client that never took part cannot be given a cluster without its data, so IFCA
has no model for unseen clients (``federation.unseen_clients``). Its local initialisation is the cluster
estimation, so it takes no ``method.ala``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from plfl.fields import checked
from plfl.methods.base import FederationContext, Method, MethodConfig, require_private_steps
from plfl.methods.clusters import ASSIGNMENTS_HEATMAP, assignments_table
from plfl.robust import weighted_average
from plfl.seeding import derive_seed
from plfl.state import Params
from plfl.tasks import EvalTask, TrainResult, Work

CLUSTER = "ifca/cluster"  # the uploaded cluster index, a 0-dim int64 tensor (also the store's key)


@dataclass
class IFCAConfig(MethodConfig):
    """IFCA's keys (Ghosh et al., NeurIPS 2020)."""

    clusters: int = checked(2, lambda v: v >= 1, "an integer >= 1", "k: the cluster models the server keeps")


def fresh_initialisation(architecture: nn.Module, seed: int, index: int, stream: str) -> Params:
    """A state dict of ``architecture`` with every module's parameters drawn afresh (``reset_parameters``), torch
    seeded by :func:`plfl.seeding.derive_seed` (``seed``, round 0, ``index``, ``stream``) without touching the
    global generator: the extra starting models of a method that keeps several (IFCA's clusters, FedEM's
    components)."""
    model = copy.deepcopy(architecture)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, 0, index, stream))
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class IFCA(Method):
    """IFCA (Ghosh et al., NeurIPS 2020): k cluster models; each client trains the one of lowest loss on its data.

    The server averages each cluster's uploads; every client receives all k models.
    """

    name = "ifca"
    not_averaging = "averages each cluster's uploads apart, which a rule over a round's models does not cover"
    config_class = IFCAConfig
    server_state = ("global_params", "models")
    matrix_options = {"method.clusters": 3}
    figures = (ASSIGNMENTS_HEATMAP,)

    def __init__(self, config: IFCAConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_private_steps(
            "ifca", context, "picks its cluster by the cluster models' losses on its training samples"
        )
        starts = [initial_params] + [self._initialisation(j) for j in range(1, config.clusters)]
        self.models = {k: torch.stack([s[k] for s in starts]) for k in initial_params}  # name → (k, *shape)

    def _initialisation(self, cluster: int) -> Params:
        """The architecture's parameters initialised afresh from the seed of cluster ``cluster``."""
        return fresh_initialisation(self.context.architecture, self.seed, cluster, "cluster_init")

    def cluster_model(self, models: Params, cluster: int) -> Params:
        """Cluster ``cluster``'s model from stacked ``models``: name → ``(k, *shape)``."""
        return {k: v[cluster].clone() for k, v in models.items()}

    def server_message(self, client_id: int, round_: int) -> Params:
        """All k cluster models, name → ``(k, *shape)``: the same tensors for every client."""
        return self.models

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Work[Params]:
        """The model of the client's estimated cluster: the lowest mean cross-entropy on its training split, the
        lower index on a tie (Alg. 1)."""
        samples = torch.arange(self.context.data.clients[client_id].num_train)
        candidates = [self.cluster_model(message, j) for j in range(self.config.clusters)]
        results = yield [EvalTask(client_id, model, samples=samples) for model in candidates]
        cluster = min(range(len(results)), key=lambda j: (results[j].loss, j))
        self.store.set(client_id, CLUSTER, cluster)
        return candidates[cluster]

    def client_message(self, client_id: int, result: TrainResult, round_: int) -> Params:
        """The trained model and the cluster it was trained for."""
        return {**result.params, CLUSTER: torch.tensor(self.store.get(client_id, CLUSTER))}

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """Each cluster's model: the mean of its uploads; a cluster without uploads keeps its model."""
        models = {k: v.clone() for k, v in self.models.items()}
        for cluster in range(self.config.clusters):
            uploads = [m for m in messages.values() if int(m[CLUSTER]) == cluster]
            if uploads:
                averaged = weighted_average([{k: m[k] for k in models} for m in uploads], [1.0] * len(uploads))
                for k, v in averaged.items():
                    models[k][cluster] = v
        self.models = models

    def new_client_model(self, round_: int) -> Optional[Params]:
        """None: a new client's cluster is the one of lowest loss on data the server never sees."""
        return None

    def round_metrics(self, round_: int) -> dict[str, float]:
        """``clusters_used``: the clusters some client chose at this round's broadcast."""
        return {"clusters_used": len(set(self.assignments()))}

    def round_tables(self, round_: int) -> dict[str, list[dict[str, Any]]]:
        """``cluster_assignments``: one row per client, ``cluster`` and a 0/1 column ``c<j>`` per cluster."""
        return assignments_table(self.assignments(), self.config.clusters)

    def assignments(self) -> list[int]:
        """Every client's cluster, estimated at the last broadcast."""
        return [self.store.get(i, CLUSTER) for i in range(len(self.store))]
