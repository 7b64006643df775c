"""IFCA (Ghosh et al., NeurIPS 2020): cluster estimation by the lowest training loss, per-cluster averaging, all k
models sent, and the planted clusters of rotated data recovered; and ``data.rotation_groups`` itself."""

import csv

import pytest
import torch
from test_validation import csv_rows

from plfl.data import load_federated_data
from plfl.data.loading import rotated
from plfl.errors import DataError
from plfl.experiment import run_experiment
from plfl.methods.ifca import CLUSTER, IFCA, IFCAConfig
from plfl.tasks import EvalTask

from conftest import make_context, run_hook, sequential


def make_method(data, clusters=3):
    context, model = make_context(data)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return IFCA(IFCAConfig(clusters=clusters), context, initial), context, initial


def test_the_k_models_start_from_the_initial_model_and_k_minus_1_seeded_initialisations(tiny_federation):
    method, _, initial = make_method(tiny_federation)
    again, _, _ = make_method(tiny_federation)
    assert all(torch.equal(method.models[k][0], initial[k]) for k in initial)
    assert all(torch.equal(method.models[k][1:], again.models[k][1:]) for k in initial)  # seeded
    assert not torch.equal(method.models["head.weight"][1], method.models["head.weight"][2])


def test_a_client_takes_the_cluster_of_lowest_training_loss(tiny_federation):
    method, context, _ = make_method(tiny_federation)
    message = method.server_message(2, 0)
    assert message["head.weight"].shape[0] == 3  # all k models are sent
    chosen = run_hook(context, method.pre_local_init(2, message, 0))
    samples = torch.arange(tiny_federation.clients[2].num_train)
    losses = [
        r.loss
        for r in sequential(context).evaluate(
            [EvalTask(2, method.cluster_model(message, j), samples=samples) for j in range(3)]
        )
    ]
    best = min(range(3), key=lambda j: losses[j])
    assert method.store.get(2, CLUSTER) == best
    assert all(torch.equal(chosen[k], message[k][best]) for k in chosen)


def test_each_cluster_averages_its_uploads_and_an_unchosen_one_keeps_its_model(tiny_federation):
    method, _, _ = make_method(tiny_federation)
    before = {k: v.clone() for k, v in method.models.items()}
    ones = {k: torch.ones_like(v[0]) for k, v in before.items()}
    threes = {k: 3 * torch.ones_like(v[0]) for k, v in before.items()}
    method.aggregate(
        {
            0: {**ones, CLUSTER: torch.tensor(2)},
            1: {**threes, CLUSTER: torch.tensor(2)},
            3: {**ones, CLUSTER: torch.tensor(0)},
        },
        1,
    )
    for k, v in method.models.items():
        if v.is_floating_point():
            assert torch.equal(v[2], torch.full_like(v[2], 2.0))  # (1 + 3) / 2, unweighted (Alg. 1)
            assert torch.equal(v[0], torch.ones_like(v[0]))
            assert torch.equal(v[1], before[k][1])


def test_rotation_groups_turn_each_clients_images_by_its_group(digits_config):
    config = digits_config(**{"data.num_clients": 4, "data.rotation_groups": 4})
    turned = load_federated_data(config.data, 0)
    config.data.rotation_groups = 1
    plain = load_federated_data(config.data, 0)
    for i, (a, b) in enumerate(zip(turned.clients, plain.clients)):
        assert torch.equal(a.x_train, torch.rot90(b.x_train, i, dims=(2, 3)))
        assert torch.equal(a.x_test, torch.rot90(b.x_test, i, dims=(2, 3)))
        assert torch.equal(a.y_train, b.y_train)


def test_rotation_groups_refuse_text(tiny_federation):
    import dataclasses

    text = dataclasses.replace(tiny_federation, input_shape=(8,), vocab_size=10)
    with pytest.raises(DataError, match="data.rotation_groups=2 rotates images"):
        rotated(text, 2)


def test_ifca_recovers_two_planted_rotation_clusters(digits_config):
    """IFCA's rotated-data experiment on digits: 8 IID clients, half of them rotated by 180°, k = 2: by round 6
    every client's cluster is its rotation group (up to the clusters' order)."""
    keys = {
        "method.name": "ifca",
        "method.clusters": 2,
        "data.num_clients": 8,
        "data.partition": "iid",
        "data.beta": 0.1,  # the default: iid reads no beta
        "data.rotation_groups": 2,
        "federation.rounds": 6,
    }
    run_dir, summary = run_experiment(digits_config(**keys))
    with open(run_dir / "tables" / "cluster_assignments.csv") as f:
        last = [int(r["cluster"]) for r in csv.DictReader(f) if r["round"] == "6"]
    groups = [i % 2 for i in range(8)]
    assert last in (groups, [1 - g for g in groups])
    metrics = csv_rows(run_dir / "metrics.csv")
    assert metrics[-1]["clusters_used"] == "2"
    model_scalars = summary["num_parameters"]
    assert summary["params_sent_per_round"] == 8 * 2 * model_scalars  # every client receives both models


def test_the_report_draws_the_clients_by_clusters_heatmap(digits_config):
    from plfl.report import load_runs
    from plfl.report.figures import all_figures

    run_dir, _ = run_experiment(digits_config(**{"method.name": "ifca", "federation.rounds": 1}))
    figures = {f.layout.title.text: f for f in all_figures(load_runs([run_dir]))}
    (heatmap,) = figures["Cluster assignments of ifca-digits, round 1"].data
    rows = [r for r in csv_rows(run_dir / "tables" / "cluster_assignments.csv") if r["round"] == "1"]
    assert [[int(r[f"c{j}"]) for j in range(2)] for r in rows] == [list(z) for z in heatmap.z]
    assert heatmap.hovertemplate.startswith("client i=%{y}, cluster j=%{x}")
