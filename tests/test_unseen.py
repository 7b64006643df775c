"""Unseen clients (``federation.unseen_clients``): held out of the federation, never read in training, tested
each evaluation on the model a new client receives (``Method.new_client_model``, fine-tuned for
``eval.finetune_epochs``), with the participation gap in metrics.csv and the summary."""

import csv
import json
from pathlib import Path

import pytest
import torch
from test_validation import csv_rows, summary_of

from plfl import experiment
from plfl.checkpoint import load_latest_checkpoint
from plfl.config import resume_config
from plfl.data import load_federated_data
from plfl.errors import ConfigError
from plfl.experiment import run_experiment
from plfl.metrics import hurt_fraction
from plfl.models import build_model
from plfl.report import load_runs
from plfl.report.figures import all_figures
from plfl.report.page import runs_table
from plfl.seeding import unseen_clients
from plfl.tasks import EvalResult

from conftest import ROOT

UNSEEN = {"federation.unseen_clients": 2, "federation.rounds": 2}


def table(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "tables" / "unseen_clients.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(("spec", "count"), [(0, 0), (0.2, 4), (0.01, 1), (0.5, 10), (3, 3), (3.0, 3)])
def test_unseen_clients_are_a_seeded_fraction_rounded_or_a_count(spec, count):
    held = unseen_clients(7, 20, spec)
    assert len(held) == count and held == sorted(set(held)) and all(0 <= i < 20 for i in held)
    assert held == unseen_clients(7, 20, spec)
    if count:
        assert any(unseen_clients(seed, 20, spec) != held for seed in range(8))


def test_holding_out_every_client_is_refused_with_the_most_that_may_be():
    with pytest.raises(ConfigError, match=r"leaves none to train; hold out fewer \(at most 4"):
        unseen_clients(0, 5, 5)


@pytest.mark.parametrize("value", [-0.1, 1.5, 2.5])
def test_an_unseen_share_that_is_neither_a_fraction_nor_a_count_is_refused(digits_config, value):
    with pytest.raises(ConfigError, match="federation.unseen_clients"):
        digits_config(**{"federation.unseen_clients": value})


def test_a_method_without_a_model_for_new_clients_is_refused_before_the_run(digits_config, tmp_path):
    config = digits_config(**UNSEEN, **{"method.name": "fedamp"})
    with pytest.raises(ConfigError, match="fedamp has no model for a client that never took part.*unseen_clients=0"):
        run_experiment(config)
    assert not list(tmp_path.iterdir())


def test_unseen_clients_data_is_never_read_in_training(digits_config, monkeypatch):
    """The unseen clients' training splits turned to NaN change nothing: not the participants' models and
    metrics, nor (without fine-tuning) the unseen clients' own; the federation counts 3 of the 5 clients."""
    clean, summary = run_experiment(digits_config(name="clean", **UNSEEN, **{"method.name": "fedala"}))
    held, load = unseen_clients(0, 5, 2), experiment.load_federated_data

    def poisoned(cfg, seed):
        data = load(cfg, seed)
        for i in held:
            data.clients[i].x_train = torch.full_like(data.clients[i].x_train, float("nan"))
        return data

    monkeypatch.setattr(experiment, "load_federated_data", poisoned)
    dirty, _ = run_experiment(digits_config(name="dirty", **UNSEEN, **{"method.name": "fedala"}))
    for name in ("metrics.csv", "clients.csv", "tables/unseen_clients.csv"):
        assert csv_rows(dirty / name) == csv_rows(clean / name)
    assert summary["num_clients"] == 3 and summary["num_unseen_clients"] == 2
    assert {r["client"] for r in csv_rows(clean / "clients.csv")} == {"0", "1", "2"}
    assert {r["client"] for r in table(clean)} == {"3", "4"}


def test_an_unseen_client_is_tested_on_the_global_model_and_the_gap_is_participating_minus_unseen(digits_config):
    """FedAvg without fine-tuning: each unseen client's correct count is the final global model's on its test
    split, computed here; unseen_accuracy pools them, and participation_gap = accuracy − unseen_accuracy."""
    run_dir, summary = run_experiment(digits_config(**UNSEEN))
    config = digits_config()
    data = load_federated_data(config.data, 0)
    model = build_model("mlp", data.input_shape, data.num_classes, hidden_sizes=[32])
    model.load_state_dict(load_latest_checkpoint(run_dir / "checkpoints")[1]["method"]["global_params"])
    held = unseen_clients(0, 5, 2)
    with torch.no_grad():
        expected = [int((model.eval()(data.clients[i].x_test).argmax(1) == data.clients[i].y_test).sum()) for i in held]
    last = [r for r in table(run_dir) if r["round"] == "2"]
    assert [int(r["correct"]) for r in last] == expected
    unseen_accuracy = sum(expected) / sum(len(data.clients[i].y_test) for i in held)
    metrics = csv_rows(run_dir / "metrics.csv")[-1]
    assert float(metrics["unseen_accuracy"]) == pytest.approx(unseen_accuracy, abs=1e-12)
    assert float(metrics["participation_gap"]) == pytest.approx(float(metrics["accuracy"]) - unseen_accuracy)
    assert summary["final_unseen_accuracy"] == pytest.approx(unseen_accuracy, abs=1e-12)
    assert summary["final_participation_gap"] == pytest.approx(float(metrics["participation_gap"]))


def test_fine_tuning_trains_each_unseen_client_on_its_own_split_from_the_new_client_model(digits_config):
    """eval.finetune_epochs=1 changes the unseen clients' results and nothing of the participants'."""
    plain, _ = run_experiment(digits_config(name="plain", **UNSEEN))
    tuned, _ = run_experiment(digits_config(name="tuned", **UNSEEN, **{"eval.finetune_epochs": 1}))
    assert csv_rows(tuned / "clients.csv") == csv_rows(plain / "clients.csv")
    assert [r["correct"] for r in table(tuned)] != [r["correct"] for r in table(plain)]


def test_the_summary_takes_the_unseen_view_at_the_best_selected_and_final_rounds(digits_config):
    run_dir, summary = run_experiment(digits_config(**{**UNSEEN, "data.val_fraction": 0.2, "federation.rounds": 3}))
    rows = {int(r["round"]): r for r in csv_rows(run_dir / "metrics.csv")}
    for rule in ("best", "selected", "final"):
        row = rows[summary[f"{rule}_round"]]
        assert summary[f"{rule}_unseen_accuracy"] == float(row["unseen_accuracy"])
        assert summary[f"{rule}_participation_gap"] == float(row["participation_gap"])


def test_a_run_with_unseen_clients_resumes_to_the_same_files(digits_config):
    config = digits_config(**{**UNSEEN, "federation.rounds": 3, "eval.finetune_epochs": 1})
    config.keep_checkpoints = 3
    run_dir, _ = run_experiment(config)
    files = ("metrics.csv", "clients.csv", "tables/unseen_clients.csv")
    straight = summary_of(run_dir), [csv_rows(run_dir / name) for name in files]
    (run_dir / "checkpoints" / "round-00003.pt").unlink()
    (run_dir / "summary.json").unlink()
    run_experiment(resume_config(run_dir), run_dir)
    assert (summary_of(run_dir), [csv_rows(run_dir / name) for name in files]) == straight
    assert json.loads((run_dir / "summary.json").read_text())["num_unseen_clients"] == 2


def test_unseen_clients_agree_on_the_sequential_and_vectorized_executors(digits_config):
    config = {**UNSEEN, "eval.finetune_epochs": 1, "method.name": "fedrep"}
    runs = {
        executor: run_experiment(digits_config(name=executor, **config, **{"federation.executor": executor}))[0]
        for executor in ("sequential", "vectorized")
    }
    sequential, vectorized = (table(runs[name]) for name in ("sequential", "vectorized"))
    assert [r["correct"] for r in vectorized] == [r["correct"] for r in sequential]
    for one, other in zip(vectorized, sequential, strict=True):
        assert float(one["test_loss"]) == pytest.approx(float(other["test_loss"]), abs=1e-4)


def test_hurt_fraction_counts_the_clients_the_global_model_serves_better():
    personal = {
        0: EvalResult(8, 10, 0.1),
        1: EvalResult(5, 10, 0.1),
        2: EvalResult(3, 4, 0.1),
        3: EvalResult(0, 0, 0.0),
    }
    global_ = {0: EvalResult(9, 10, 0.1), 1: EvalResult(5, 10, 0.1), 2: EvalResult(1, 4, 0.1), 3: EvalResult(0, 0, 0.0)}
    assert hurt_fraction(personal, global_) == pytest.approx(1 / 3)  # client 0 of the 3 with test samples


def test_a_method_with_a_global_model_scores_it_on_every_participating_client(digits_config):
    """Ditto: clients.csv holds the global model's result per client; global_accuracy pools them and
    personalization_hurt_fraction counts the clients where it beats the personalized model."""
    run_dir, _ = run_experiment(digits_config(**{**UNSEEN, "method.name": "ditto"}))
    clients = [r for r in csv_rows(run_dir / "clients.csv") if r["round"] == "2"]
    metrics = csv_rows(run_dir / "metrics.csv")[-1]
    pooled = sum(int(r["global_correct"]) for r in clients) / sum(int(r["num_test"]) for r in clients)
    assert float(metrics["global_accuracy"]) == pytest.approx(pooled, abs=1e-12)
    hurt = sum(float(r["accuracy"]) < float(r["global_accuracy"]) for r in clients) / len(clients)
    assert float(metrics["personalization_hurt_fraction"]) == pytest.approx(hurt)


def test_the_report_draws_unseen_against_participating_clients_and_tabulates_the_gap(digits_config):
    keys = {**UNSEEN, "federation.system.sample_seconds": 0.001}
    run_dir, summary = run_experiment(digits_config(**keys))
    runs = load_runs([run_dir])
    figures = {f.layout.title.text: f for f in all_figures(runs)}
    unseen, participating = figures[
        "Unseen clients' accuracy (solid) and participating clients' accuracy (dotted)"
    ].data
    metrics = csv_rows(run_dir / "metrics.csv")
    assert list(unseen.y) == pytest.approx([100 * float(r["unseen_accuracy"]) for r in metrics])
    assert list(participating.y) == pytest.approx([100 * float(r["accuracy"]) for r in metrics])
    table = runs_table(runs)
    assert '<th title="federation.unseen_clients, at the final round">unseen accuracy (%)</th>' in table
    assert f'<td class="num">{100 * summary["final_participation_gap"]:.2f}</td>' in table
    assert "simulated s / round" in table


def test_fit_prints_the_unseen_clients_and_the_simulated_time(tmp_path, capsys):
    from plfl.cli import main

    main([
        "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), f"output_dir={tmp_path}", "progress_bar=false",
        "federation.rounds=1", "data.num_clients=5", "federation.unseen_clients=1",
        "federation.system.sample_seconds=0.001", "federation.system.dropout=0.5",
    ])  # fmt: skip
    out = capsys.readouterr().out
    summary = json.loads(next(tmp_path.rglob("summary.json")).read_text())
    assert (
        f"Unseen clients (1) at the final round {100 * summary['final_unseen_accuracy']:.2f} %, participation gap "
        f"{100 * summary['final_participation_gap']:+.2f} points"
    ) in out
    assert f"Simulated {summary['simulated_seconds_per_round']:.2f} s per round; client-rounds dropped out " in out
