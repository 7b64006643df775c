"""Validation splits (``data.val_fraction``): held out of each client's training split and never trained on,
scored as the test split is on every executor, and the round selected on them (summary.json's
``selected_round``), which plfl fit, plfl compare and plfl report show."""

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from plfl.checkpoint import load_latest_checkpoint
from plfl.compare import comparison_table, dataset_name, read_run
from plfl.config import DataConfig, resume_config, validate
from plfl.data import ClientData, FederatedData, load_federated_data, loading
from plfl.data.loading import hold_out_validation
from plfl.errors import ConfigError, DataError
from plfl.executors import SequentialExecutor, VectorizedExecutor
from plfl.executors.options import ClientWorkOptions, Vectorized
from plfl.experiment import run_experiment
from plfl.federation import FederationLoop
from plfl.metrics import selected_round
from plfl.report import load_runs
from plfl.report.page import runs_table
from plfl.sections import FederationConfig, TrainerConfig
from plfl.tasks import EvalTask

from conftest import make_context, sequential
from test_data import write_pfllib

TIMING = ("seconds", "seconds_per_round", "total_seconds")


def vectorized(context, cohort_size: int) -> VectorizedExecutor:
    """The vectorized executor of ``context`` on the CPU in cohorts of ``cohort_size``."""
    federation = FederationConfig(**{**vars(context.federation), "executor": "vectorized"})
    work, options = ClientWorkOptions(federation, TrainerConfig(), False), Vectorized(cohort_size=cohort_size)
    return VectorizedExecutor(
        context.data, context.architecture, work, options, torch.device("cpu"), sequential(context)
    )


def csv_rows(path: Path) -> list[dict[str, str]]:
    """A CSV's rows without the wall-clock column."""
    with open(path) as f:
        return [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(f)]


def summary_of(run_dir: Path) -> dict:
    """summary.json without its wall-clock keys."""
    return {k: v for k, v in json.loads((run_dir / "summary.json").read_text()).items() if k not in TIMING}


def client_models(run_dir: Path) -> list[dict[str, torch.Tensor]]:
    return [client["model"] for client in load_latest_checkpoint(run_dir / "checkpoints")[1]["store"]]


def ids_federation() -> FederatedData:
    """3 clients whose samples are their own ids (x = the id, (n, 1)): train ids 0..n-1 + 100·c, test ids from
    1000; client 0 holds 8 samples of class 0 and 8 of class 1, client 1 ten of classes 0..4 twice, client 2 three."""
    labels = [[0] * 8 + [1] * 8, [0, 1, 2, 3, 4] * 2, [0, 1, 1]]
    clients = []
    for c, y in enumerate(labels):
        ids = torch.arange(len(y), dtype=torch.float32) + 100 * c
        test = torch.arange(4, dtype=torch.float32) + 1000 + 10 * c
        clients.append(ClientData(ids[:, None], torch.tensor(y), test[:, None], torch.zeros(4, dtype=torch.long)))
    return FederatedData("ids", clients, num_classes=5, input_shape=(1,))


def ids(x: torch.Tensor) -> list[int]:
    return [int(v) for v in x[:, 0].tolist()]


def test_the_validation_split_is_held_out_of_the_training_split_disjoint_seeded_and_stratified():
    data = ids_federation()
    held = hold_out_validation(data, 0.25, seed=0)
    assert held.has_validation and not data.has_validation
    for before, after in zip(data.clients, held.clients):
        train, val = ids(after.x_train), ids(after.x_val)
        assert not set(train) & set(val) and sorted(train + val) == ids(before.x_train)
        assert train == sorted(train) and val == sorted(val)  # the training split's order is kept
        assert after.num_val == math.ceil(0.25 * before.num_train)  # ceil(share · n), at least 1
        assert torch.equal(after.x_test, before.x_test) and not set(ids(after.x_test)) & set(train + val)
        assert after.num_samples == before.num_samples
        assert sorted(after.y_val.tolist() + after.y_train.tolist()) == sorted(before.y_train.tolist())
    assert [c.num_val for c in held.clients] == [4, 3, 1]
    for seed in range(5):  # stratified: 2 of each class, whatever the draw
        assert sorted(hold_out_validation(data, 0.25, seed).clients[0].y_val.tolist()) == [0, 0, 1, 1]
    assert ids(hold_out_validation(data, 0.25, seed=0).clients[0].x_val) == ids(held.clients[0].x_val)
    assert any(
        ids(hold_out_validation(data, 0.25, seed=s).clients[0].x_val) != ids(held.clients[0].x_val) for s in (1, 2)
    )


def test_a_client_with_one_training_sample_cannot_hold_out_a_validation_sample():
    data = ids_federation()
    small = data.clients[2]
    data.clients[2] = ClientData(small.x_train[:1], small.y_train[:1], small.x_test, small.y_test)
    with pytest.raises(DataError, match=r"^Client 2: A client has 1 training sample\(s\); data.val_fraction=0.25"):
        hold_out_validation(data, 0.25, seed=0)


def test_a_pooled_source_keeps_its_test_splits_and_gives_part_of_each_training_split_to_validation():
    plain = load_federated_data(DataConfig(source="digits", num_clients=5, beta=0.5), 0)
    held = load_federated_data(DataConfig(source="digits", num_clients=5, beta=0.5, val_fraction=0.2), 0)
    for before, after in zip(plain.clients, held.clients):
        assert torch.equal(after.x_test, before.x_test) and torch.equal(after.y_test, before.y_test)
        assert after.num_val == math.ceil(0.2 * before.num_train)
        rows = sorted(map(tuple, torch.cat([after.x_train, after.x_val]).flatten(1).tolist()))
        assert rows == sorted(map(tuple, before.x_train.flatten(1).tolist()))
        assert sorted(torch.cat([after.y_train, after.y_val]).tolist()) == sorted(before.y_train.tolist())
    assert not plain.has_validation and all(c.num_val == 0 for c in plain.clients)


def test_a_source_with_its_own_split_gives_part_of_its_training_split_to_validation(tmp_path):
    root = write_pfllib(tmp_path / "d", [([0, 1, 1, 0, 1, 0, 2, 2], [1]), ([2, 2, 0, 0], [0, 2])])
    plain = load_federated_data(DataConfig(source="pfllib", root=str(root)), 0)
    held = load_federated_data(DataConfig(source="pfllib", root=str(root), val_fraction=0.25), 0)
    assert [c.num_val for c in held.clients] == [2, 1] and [c.num_train for c in held.clients] == [6, 3]
    for before, after in zip(plain.clients, held.clients):
        assert torch.equal(after.y_test, before.y_test)
        assert sorted(after.y_train.tolist() + after.y_val.tolist()) == sorted(before.y_train.tolist())
    validate(OmegaConf.create({"data": {"source": "pfllib", "root": str(root), "val_fraction": 0.25}}))


@pytest.mark.parametrize("value", [1, -0.1])
def test_a_val_fraction_outside_0_to_1_is_refused(value):
    with pytest.raises(ConfigError, match=r"data\.val_fraction"):
        validate(OmegaConf.create({"data": {"val_fraction": value}}))


def test_an_evaluation_of_the_validation_split_names_no_samples():
    with pytest.raises(ValueError, match="validation split names no samples"):
        EvalTask(0, {}, split="val", samples=torch.tensor([0]))
    with pytest.raises(ValueError, match='"test" or "val"'):
        EvalTask(0, {}, split="train")


def test_selected_round_is_the_earliest_of_the_highest_validation_accuracy():
    rows = [
        {"round": 0, "accuracy": 0.1, "val_accuracy": 0.2},
        {"round": 1, "train_loss": 1.0},  # not evaluated
        {"round": 2, "accuracy": 0.5, "val_accuracy": 0.6},
        {"round": 3, "accuracy": 0.9, "val_accuracy": 0.6},  # a tie: the earlier round stays
        {"round": 4, "accuracy": 0.95, "val_accuracy": 0.4},  # the best on test, not selected
        {"round": 5, "accuracy": 0.7, "val_accuracy": float("nan")},
    ]
    assert selected_round(rows) == (2, 0.5)
    assert selected_round(rows[:1]) == (0, 0.1)
    assert selected_round([{"round": 0, "accuracy": 0.3}]) is None and selected_round([]) is None


def test_val_fraction_0_is_a_run_without_the_key(digits_config):
    """Same clients, same numbers, the same files: no validation column and no selected round."""
    plain, _ = run_experiment(digits_config(name="plain"))
    zero, _ = run_experiment(digits_config(name="zero", **{"data.val_fraction": 0}))
    for name in ("metrics.csv", "clients.csv"):
        assert csv_rows(zero / name) == csv_rows(plain / name)
    assert summary_of(zero) == summary_of(plain) and "selected_round" not in summary_of(plain)
    assert not [c for c in csv_rows(plain / "metrics.csv")[0] if c.startswith("val_")]
    assert not [c for c in csv_rows(plain / "clients.csv")[0] if c.startswith("val_") or c == "num_val"]
    for one, other in zip(client_models(zero), client_models(plain)):
        assert all(torch.equal(one[k], other[k]) for k in one)


def test_validation_samples_are_never_trained_on(digits_config, monkeypatch):
    """Validation labels changed to wrong ones change the validation accuracy and nothing else: no model, test
    number or training loss; and local training sees n − ⌈0.3 n⌉ of a client's n training samples."""
    config = {"data.val_fraction": 0.3, "method.name": "fedala", "method.p": 2, "federation.rounds": 2}
    clean, _ = run_experiment(digits_config(name="clean", **config))
    hold_out, training_split, seen = loading.hold_out_validation, SequentialExecutor._training_split, {}

    def recorded(self, client_id, samples):
        x, y = training_split(self, client_id, samples)
        seen.setdefault(client_id, set()).add(len(y))
        return x, y

    monkeypatch.setattr(SequentialExecutor, "_training_split", recorded)

    def poisoned(data, val_fraction, seed):
        held = hold_out(data, val_fraction, seed)
        for client in held.clients:
            client.y_val = (client.y_val + 1) % held.num_classes
        return held

    monkeypatch.setattr(loading, "hold_out_validation", poisoned)
    dirty, _ = run_experiment(digits_config(name="dirty", **config))

    def without_validation(rows):
        return [{k: v for k, v in r.items() if not k.startswith("val_")} for r in rows]

    for name in ("metrics.csv", "clients.csv"):
        assert without_validation(csv_rows(dirty / name)) == without_validation(csv_rows(clean / name))
    for one, other in zip(client_models(dirty), client_models(clean)):
        assert all(torch.equal(one[k], other[k]) for k in one)
    clean_val = [float(r["val_accuracy"]) for r in csv_rows(clean / "metrics.csv")]
    dirty_val = [float(r["val_accuracy"]) for r in csv_rows(dirty / "metrics.csv")]
    assert clean_val != dirty_val
    plain = load_federated_data(DataConfig(source="digits", num_clients=5, beta=0.5), 0)
    expected = {i: {c.num_train - math.ceil(0.3 * c.num_train)} for i, c in enumerate(plain.clients)}
    assert seen == expected  # every client trains every round (join_ratio 1)


def test_a_client_is_validated_with_the_model_its_test_accuracy_uses(digits_config, monkeypatch):
    """Every evaluation call that scores a client on its test split scores the same parameters (the very
    object, the personalized model for pFedMe) on its validation split."""
    calls = []
    evaluate = FederationLoop._evaluate

    def recorded(self, round_):
        executor = self.clients.executor
        original = executor.evaluate

        def spy(tasks):
            calls.append(list(tasks))
            return original(tasks)

        executor.evaluate = spy
        try:
            return evaluate(self, round_)
        finally:
            executor.evaluate = original

    monkeypatch.setattr(FederationLoop, "_evaluate", recorded)
    run_experiment(digits_config(**{"data.val_fraction": 0.2, "method.name": "pfedme", "federation.rounds": 1}))
    val_calls = [k for k, tasks in enumerate(calls) if any(t.split == "val" for t in tasks)]
    assert len(val_calls) == 2  # rounds 0 and 1; each comes right after the same clients' test split
    for k in val_calls:
        test = {t.client_id: t.params for t in calls[k - 1] if t.split == "test"}
        tasks = calls[k]
        val = {t.client_id: t.params for t in tasks if t.split == "val"}
        assert sorted(test) == sorted(val) == list(range(5))
        assert all(val[i] is test[i] for i in test)


def test_a_run_with_validation_scores_every_evaluated_round_and_selects_on_it(digits_config, capsys):
    """val_accuracy and val_loss are sample-weighted over the clients as accuracy and test_loss are; the summary
    selects the round of best val_accuracy; compare and report show it."""
    run_dir, summary = run_experiment(
        digits_config(**{"data.val_fraction": 0.2, "federation.rounds": 4, "federation.eval_every": 3})
    )
    metrics, clients = csv_rows(run_dir / "metrics.csv"), csv_rows(run_dir / "clients.csv")
    evaluated = [r for r in metrics if r["accuracy"]]
    assert [r["round"] for r in evaluated] == ["0", "3", "4"]
    assert all(not r["val_accuracy"] and not r["val_loss"] for r in metrics if not r["accuracy"])
    for row in evaluated:
        ones = [c for c in clients if c["round"] == row["round"]]
        assert len(ones) == 5 and all(int(c["num_val"]) > 0 for c in ones)
        total = sum(int(c["num_val"]) for c in ones)
        assert float(row["val_accuracy"]) == pytest.approx(sum(int(c["val_correct"]) for c in ones) / total)
        weighted = sum(float(c["val_loss"]) * int(c["num_val"]) for c in ones) / total
        assert float(row["val_loss"]) == pytest.approx(weighted)
        assert all(float(c["val_accuracy"]) == int(c["val_correct"]) / int(c["num_val"]) for c in ones)
    chosen = max(evaluated, key=lambda r: (float(r["val_accuracy"]), -int(r["round"])))
    assert summary["selected_round"] == int(chosen["round"])
    assert summary["selected_accuracy"] == float(chosen["accuracy"])
    assert summary["best_accuracy"] == max(float(r["accuracy"]) for r in evaluated)
    assert summary_of(run_dir)["selected_round"] == summary["selected_round"]

    record = read_run(run_dir)
    assert record.selected_accuracy == summary["selected_accuracy"]
    assert record.dataset == "digits Dir(0.5), 5 clients, 20 % validation"
    table = comparison_table([record])
    assert table.splitlines()[0] == "| method | digits Dir(0.5), 5 clients, 20 % validation (selected on validation) |"
    assert f"| fedavg | {100 * summary['selected_accuracy']:.2f} (n=1) |" in table
    (run,) = load_runs([run_dir])
    cells = runs_table([run])
    assert "selected accuracy (%)</th><th>selected round</th>" in cells
    assert (
        f'<td class="num">{100 * summary["selected_accuracy"]:.2f}</td><td class="num">{summary["selected_round"]}'
        f'</td><td class="num">{100 * summary["best_accuracy"]:.2f}</td>' in cells
    )


def fake_run(path: Path, source: str, best: float, selected=None, val_fraction=None) -> Path:
    """A finished run's config.yaml and summary.json (only what plfl compare reads)."""
    path.mkdir(parents=True)
    data = {"source": source, "root": None, **({"val_fraction": val_fraction} if val_fraction is not None else {})}
    OmegaConf.save({"method": {"name": "fedavg"}, "data": data, "federation": {"seed": 0}}, path / "config.yaml")
    summary = {"status": "completed", "best_accuracy": best, "seconds_per_round": 1.0, "params_sent_per_round": 1.0}
    if selected is not None:
        summary.update(selected_accuracy=selected, selected_round=1)
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_compare_heads_each_column_with_its_rule_and_selects_on_validation_where_runs_can(tmp_path):
    records = [
        read_run(fake_run(tmp_path / "a", "leaf", 0.9)),
        read_run(fake_run(tmp_path / "b", "leaf", 0.8, selected=0.7, val_fraction=0.1)),
        read_run(fake_run(tmp_path / "c", "leaf", 0.6, selected=0.5, val_fraction=0.1)),
    ]
    lines = comparison_table(records).splitlines()
    assert lines[0] == "| method | leaf (best on test) | leaf, 10 % validation (selected on validation) |"
    assert lines[2] == "| fedavg | 90.00 (n=1) | 60.00 ± 10.00 (n=2) |"  # 0.7 and 0.5, not 0.8 and 0.6
    assert lines[4].startswith("Selected on validation: the test accuracy at the round of highest validation")
    assert "optimistic" in lines[4]
    assert comparison_table(records[:1]).splitlines()[0] == "| method | leaf |"  # no validation: as before


def test_dataset_names_say_the_validation_share_only_where_there_is_one():
    def name(**data):
        return dataset_name(OmegaConf.create({"data": {"source": "shakespeare", **data}}))

    assert name() == name(val_fraction=0) == "shakespeare"
    assert name(val_fraction=0.15) == "shakespeare, 15 % validation"


def test_vectorized_scores_validation_splits_as_sequential_beside_test_splits(tiny_federation):
    """Test and validation tasks in one call: each on its own split (a recorded evaluation step never reads the
    other split), as the sequential executor scores them and as a call of validation tasks alone does."""
    data = hold_out_validation(tiny_federation, 0.3, seed=0)
    context, model = make_context(data)
    params = [{k: v + 0.01 * i for k, v in model.state_dict().items()} for i in range(4)]
    tasks = [EvalTask(i, p) for i, p in enumerate(params)] + [EvalTask(i, p, split="val") for i, p in enumerate(params)]
    together = vectorized(context, cohort_size=3).evaluate(tasks)
    alone = vectorized(context, cohort_size=3).evaluate(tasks[4:])
    expected = sequential(context).evaluate(tasks)
    assert [r.total for r in together] == [6] * 4 + [c.num_val for c in data.clients] == [r.total for r in expected]
    assert [c.num_val for c in data.clients] == [3, 6, 9, 12]
    for one, other in zip(together, expected):
        assert one.correct == other.correct and one.loss == pytest.approx(other.loss, abs=1e-6)
    for one, other in zip(together[4:], alone):
        assert (one.correct, one.total, one.loss) == (other.correct, other.total, other.loss)


def test_runs_with_validation_agree_on_the_sequential_and_vectorized_executors(digits_config):
    config = {"data.val_fraction": 0.2, "method.name": "fedala", "method.p": 2}
    runs = {
        executor: run_experiment(digits_config(name=executor, **config, **{"federation.executor": executor}))
        for executor in ("sequential", "vectorized")
    }
    (seq_dir, seq), (vec_dir, vec) = runs["sequential"], runs["vectorized"]
    for name, columns in (("metrics.csv", ("accuracy", "val_accuracy", "val_loss")), ("clients.csv", ("val_loss",))):
        for one, other in zip(csv_rows(vec_dir / name), csv_rows(seq_dir / name), strict=True):
            for column in columns:
                if other[column]:
                    assert float(one[column]) == pytest.approx(float(other[column]), abs=1e-5)
    assert [r["val_correct"] for r in csv_rows(vec_dir / "clients.csv")] == [
        r["val_correct"] for r in csv_rows(seq_dir / "clients.csv")
    ]
    assert (vec["selected_round"], vec["best_round"]) == (seq["selected_round"], seq["best_round"])
    assert vec["selected_accuracy"] == pytest.approx(seq["selected_accuracy"], abs=1e-9)


def test_a_resumed_run_selects_the_round_an_uninterrupted_one_does(digits_config):
    """A 4-round run resumed from its round-2 checkpoint (its later checkpoints and summary removed, as a run
    killed in round 3 leaves them) ends with the same files and summary, the selected round included."""
    config = digits_config(**{"data.val_fraction": 0.2, "federation.rounds": 4})
    config.keep_checkpoints = 3
    run_dir, _ = run_experiment(config)
    straight = summary_of(run_dir), csv_rows(run_dir / "metrics.csv"), csv_rows(run_dir / "clients.csv")
    for r in (3, 4):
        (run_dir / "checkpoints" / f"round-0000{r}.pt").unlink()
    (run_dir / "summary.json").unlink()
    resumed, summary = run_experiment(resume_config(run_dir), run_dir)
    assert resumed == run_dir and summary["rounds"] == 4 and "selected_round" in summary
    assert (summary_of(run_dir), csv_rows(run_dir / "metrics.csv"), csv_rows(run_dir / "clients.csv")) == straight


def test_fit_prints_the_selected_accuracy_first(digits_config, capsys):
    from plfl.cli import main

    config = digits_config(**{"data.val_fraction": 0.2, "federation.rounds": 1})
    path = Path(config.output_dir) / "run.yaml"
    OmegaConf.save(config, path)
    assert main(["fit", "--config", str(path)]) in (0, None)
    line = next(li for li in capsys.readouterr().out.splitlines() if "accuracy" in li.lower())
    assert line.startswith("Accuracy selected on validation ") and "; best on test " in line
