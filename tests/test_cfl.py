"""CFL (Sattler et al., IEEE TNNLS 2021): the update norms and cosine similarities, the bipartition against the
exhaustive argmin, the γ criterion, the per-cluster aggregation of updates and a split's halves, what is sent, FedAvg
when nothing splits, and the planted rotation groups recovered on digits."""

import csv
import itertools

import numpy as np
import pytest
import torch
from test_validation import csv_rows

from plfl.experiment import run_experiment
from plfl.methods.cfl import (
    CFL,
    CFLConfig,
    bipartition,
    cosine_similarities,
    cross_similarity,
    splits,
    update_norms,
)

from conftest import make_context, run_hook


def make_method(data, **options):
    context, model = make_context(data)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return CFL(CFLConfig(**options), context, initial), context, initial


def test_update_norms_and_cosine_similarities_by_hand():
    updates = torch.tensor([[3.0, 4.0], [0.0, 2.0], [-3.0, -4.0], [0.0, 0.0]], dtype=torch.float64)
    mean, largest = update_norms(updates[:2], [1.0, 3.0])  # (3, 4)/4 + 3 (0, 2)/4 = (0.75, 2.5)
    assert mean == pytest.approx((0.75**2 + 2.5**2) ** 0.5) and largest == 5.0
    alpha = cosine_similarities(updates)
    expected = np.array([[1, 0.8, -1, 0], [0.8, 1, -0.8, 0], [-1, -0.8, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(alpha, expected, atol=1e-12)


def brute_force(alpha: np.ndarray) -> float:
    """min over all bipartitions of the largest cross similarity."""
    n = len(alpha)
    best = np.inf
    for size in range(1, n):
        for first in itertools.combinations(range(n), size):
            second = [j for j in range(n) if j not in first]
            best = min(best, alpha[np.ix_(list(first), second)].max())
    return best


@pytest.mark.parametrize("seed", range(5))
def test_single_linkage_is_the_papers_argmin_of_the_largest_cross_similarity(seed):
    alpha = cosine_similarities(torch.randn(7, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    first, second = bipartition(alpha, "single")
    assert sorted(first + second) == list(range(7)) and 0 in first
    assert cross_similarity(alpha, first, second) == pytest.approx(brute_force(alpha))


def test_complete_linkage_splits_two_planted_directions_and_keeps_them_whole():
    base = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    noise = 0.1 * torch.randn(6, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    updates = base[[0, 1, 1, 0, 1, 0]] + noise
    for linkage in ("single", "complete"):
        assert bipartition(cosine_similarities(updates), linkage) == ([0, 3, 5], [1, 2, 4])
    with pytest.raises(ValueError, match="square similarity matrix of >= 2 rows"):
        bipartition(np.ones((1, 1)))


def test_the_gamma_criterion():
    assert splits(0.0, 0.99) and not splits(0.0, 1.0)  # γ_max = 0: only identical directions stay together
    assert splits(0.49, 0.5) and not splits(0.5, 0.5)  # √((1 − 0.5)/2) = 0.5
    assert splits(0.7, -1.0) and not splits(1.0, -1.0)  # opposite updates: √1 = 1


def test_a_client_receives_its_clusters_model_and_uploads_its_update(tiny_federation):
    method, context, initial = make_method(tiny_federation)
    message = method.server_message(2, 0)
    assert all(torch.equal(message[k], initial[k]) for k in initial)
    result = run_hook(context, method.local_train(2, dict(message), message, 1))
    for k, v in result.params.items():
        assert torch.equal(result.upload[k], v - message[k])
    assert not torch.equal(result.params["head.weight"], message["head.weight"])


def updates_along(initial, directions):
    """Client i's update: ``directions[i]`` times a ones tensor of every floating-point key."""
    return {i: {k: d * torch.ones_like(v) for k, v in initial.items()} for i, d in enumerate(directions)}


def test_a_cluster_moves_by_the_sample_weighted_mean_update_and_splits_only_past_the_warm_up(tiny_federation):
    method, _, initial = make_method(tiny_federation, warmup_rounds=1)
    messages = updates_along(initial, [1.0, 2.0, 3.0, 4.0])  # sizes 10, 20, 30, 40: mean 3
    method.aggregate(messages, 1)
    assert method.clusters == [[0, 1, 2, 3]]
    for k, v in initial.items():
        torch.testing.assert_close(method.models[k][0], v + 3.0)


def test_equal_update_weights_move_a_cluster_by_the_plain_mean_and_test_its_norm(tiny_federation):
    method, _, initial = make_method(tiny_federation, update_weights="equal", warmup_rounds=5)
    messages = updates_along(initial, [1.0, 2.0, 3.0, 4.0])  # sizes 10, 20, 30, 40, ignored: mean 2.5
    method.aggregate(messages, 1)
    for k, v in initial.items():
        torch.testing.assert_close(method.models[k][0], v + 2.5)
    parameters = sum(v.numel() for _, v in method.context.architecture.named_parameters())
    assert method.update_rows[0]["mean_update_norm"] == pytest.approx(2.5 * parameters**0.5)


def test_a_split_cluster_moves_each_half_by_its_own_updates(tiny_federation):
    method, _, initial = make_method(tiny_federation, warmup_rounds=0, eps1=10.0, eps2=0.0, gamma_max=0.5)
    keys = method.parameter_names
    messages = {}
    for i, sign in enumerate([1.0, -1.0, 1.0, -1.0]):  # clients 0, 2 along +x, 1, 3 along −x: α_cross = −1
        flat = torch.zeros(sum(initial[k].numel() for k in keys))
        flat[0], flat[1 + i] = sign, 0.01 * (i + 1)
        parts = flat.split([initial[k].numel() for k in keys])
        messages[i] = {k: p.reshape(initial[k].shape) for k, p in zip(keys, parts)}
    method.aggregate(messages, 1)
    assert method.clusters == [[0, 2], [1, 3]] and method.assignments() == [0, 1, 0, 1]
    for c, members in enumerate(method.clusters):
        sizes = [10 * (i + 1) for i in members]
        for k in keys:
            mean = sum(n * messages[i][k] for n, i in zip(sizes, members)) / sum(sizes)
            torch.testing.assert_close(method.models[k][c], initial[k] + mean)
    (row,) = method.round_tables(1)["cluster_updates"]
    cross = -1 / ((1 + 0.03**2) * (1 + 0.04**2)) ** 0.5  # clients 2 and 3, the least opposed pair
    assert row["split"] == 1 and row["cross_similarity"] == pytest.approx(cross)
    assert method.round_metrics(1) == {"clusters": 2}
    assert [r["cluster"] for r in method.round_tables(1)["cluster_assignments"]] == [0, 1, 0, 1]
    method.aggregate(messages, 2)  # 2 clients each: below min_cluster_size 3, no further split
    assert method.clusters == [[0, 2], [1, 3]]
    assert set(method.state_dict()) == {"models", "clusters"}
    assert method.new_client_model(2) is None  # a new client has no cluster: unseen clients are refused


def test_a_cluster_is_not_split_when_the_gamma_criterion_fails_or_a_client_did_not_upload(tiny_federation):
    method, _, initial = make_method(tiny_federation, warmup_rounds=0, eps1=1e6, eps2=0.0, gamma_max=1.0)
    messages = updates_along(initial, [1.0, 2.0, -3.0, 4.0])
    method.aggregate(messages, 1)  # γ_max = 1 refuses any split
    assert method.clusters == [[0, 1, 2, 3]]
    method.config.gamma_max = 0.0
    method.aggregate({i: m for i, m in messages.items() if i != 3}, 2)  # client 3 sat out
    assert method.clusters == [[0, 1, 2, 3]]
    method.aggregate(messages, 3)
    assert method.clusters == [[0, 1, 3], [2]]


def test_without_splits_cfl_is_fedavg(digits_config):
    """The ε2 test never passes: one cluster, whose model is FedAvg's (to rounding)."""
    runs = [
        run_experiment(digits_config(**{"method.name": name, **extra}))[0]
        for name, extra in (("fedavg", {}), ("cfl", {"method.eps2": 1000.0, "method.warmup_rounds": 0}))
    ]
    fedavg, cfl = (csv_rows(r / "metrics.csv") for r in runs)
    assert [round(float(r["accuracy"]), 4) for r in cfl] == [round(float(r["accuracy"]), 4) for r in fedavg]
    assert {r["clusters"] for r in cfl} == {"1"} and cfl[-1]["params_sent"] == fedavg[-1]["params_sent"]


@pytest.mark.parametrize("linkage", ["single", "complete"])
def test_cfl_separates_two_planted_rotation_groups_exactly(digits_config, linkage):
    """8 IID digits clients, clients 1, 3, 5, 7 turned by 180°: the first test (round 2) splits the clients into
    exactly their rotation groups (α_cross ≈ 0.3); the splits inside a group (α_cross ≈ 0.75) fail γ_max = 0.45."""
    keys = {
        "method.name": "cfl",
        "method.linkage": linkage,
        "method.eps1": 0.2,
        "method.eps2": 0.1,
        "method.gamma_max": 0.45,
        "method.warmup_rounds": 1,
        "data.num_clients": 8,
        "data.partition": "iid",
        "data.beta": 0.1,  # the default: iid reads no beta
        "data.rotation_groups": 2,
        "federation.rounds": 4,
    }
    run_dir, summary = run_experiment(digits_config(**keys))
    with open(run_dir / "tables" / "cluster_assignments.csv") as f:
        rows = list(csv.DictReader(f))
    by_round = {r: [int(x["cluster"]) for x in rows if x["round"] == str(r)] for r in range(5)}
    assert by_round[1] == [0] * 8
    assert by_round[2] == by_round[4] == [i % 2 for i in range(8)]
    updates = csv_rows(run_dir / "tables" / "cluster_updates.csv")
    later = [r for r in updates if r["round"] in ("3", "4")]
    assert len(later) == 4 and all(r["split"] == "0" and float(r["cross_similarity"]) > 1 - 2 * 0.45**2 for r in later)
    metrics = csv_rows(run_dir / "metrics.csv")
    assert [r["clusters"] for r in metrics] == ["1", "1", "2", "2", "2"]
    assert summary["params_sent_per_round"] == 8 * summary["num_parameters"]  # each client: its cluster's model


def test_the_report_draws_the_assignments_heatmap_with_a_column_per_cluster(digits_config):
    from plfl.report import load_runs
    from plfl.report.figures import all_figures

    options = {"method.warmup_rounds": 0, "method.eps1": 1000.0, "method.eps2": 0.0, "method.min_cluster_size": 2}
    run_dir, _ = run_experiment(digits_config(**{"method.name": "cfl", "federation.rounds": 2, **options}))
    rows = [r for r in csv_rows(run_dir / "tables" / "cluster_assignments.csv") if r["round"] == "2"]
    clusters = int(csv_rows(run_dir / "metrics.csv")[-1]["clusters"])
    assert clusters > 2  # split in round 1 and again in round 2
    figures = {f.layout.title.text: f for f in all_figures(load_runs([run_dir]))}
    (heatmap,) = figures["Cluster assignments of cfl-digits, round 2"].data
    assert [[int(r[f"c{j}"]) for j in range(clusters)] for r in rows] == [list(z) for z in heatmap.z]
