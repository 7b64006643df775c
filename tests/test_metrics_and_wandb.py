"""Federation metrics checked by hand, and W&B logging in offline mode."""

import pytest

from plfl.cli import main
from plfl.config import resume_config
from plfl.data import load_federated_data
from plfl.experiment import run_experiment
from plfl.metrics import federation_metrics, largest_accuracy, largest_clients
from plfl.report.runs import read_csv
from plfl.tasks import EvalResult


def test_federation_metrics_by_hand():
    results = {
        i: EvalResult(c, n, loss)
        for i, (c, n, loss) in enumerate(
            [(9, 10, 0.1), (1, 10, 0.5), (30, 40, 0.2)] + [(5, 10, 1.0)] * 7 + [(0, 0, float("nan"))]
        )
    }
    sizes = {i: 50 for i in range(11)} | {2: 60, 10: 500}  # the largest client, 10, has no test samples
    m = federation_metrics(results, sizes)
    assert m["accuracy"] == pytest.approx((9 + 1 + 30 + 35) / (10 + 10 + 40 + 70))
    per_client = [0.9, 0.1, 0.75] + [0.5] * 7  # the client without test samples is left out
    assert m["client_accuracy_mean"] == pytest.approx(sum(per_client) / 10)
    assert m["worst10_accuracy"] == pytest.approx(0.1)  # ⌈10 % of 10⌉ = 1 client
    assert m["largest10_accuracy"] == pytest.approx(0.75)  # client 2 (60 samples); 10 has no test split
    assert m["test_loss"] == pytest.approx((1 + 5 + 8 + 70) / 130)


def test_largest10_accuracy_weighs_the_largest_tenth_by_test_samples():
    # 20 clients: ⌈10 % of 20⌉ = 2, the clients with the most train + test samples (7 and 13), not the best ones.
    sizes = {i: 100 + i for i in range(20)} | {7: 900, 13: 800}
    results = {i: EvalResult(i, 20, 0.0) for i in range(20)}  # client 19 is the most accurate
    results[7], results[13] = EvalResult(3, 10, 0.0), EvalResult(27, 30, 0.0)
    assert largest_clients(sizes, range(20)) == [7, 13]
    assert largest_accuracy(results, sizes) == pytest.approx((3 + 27) / (10 + 30))  # not (0.3 + 0.9) / 2
    # 21 clients: ⌈2.1⌉ = 3, the third the largest of the rest (client 19, 119 samples).
    sizes[20], results[20] = 5, EvalResult(0, 20, 0.0)
    assert largest_clients(sizes, range(21)) == [7, 13, 19]
    assert largest_accuracy(results, sizes) == pytest.approx((3 + 27 + 19) / (10 + 30 + 20))


def test_largest10_ties_go_to_the_lower_client_id_and_few_clients_give_the_one_largest():
    # Clients 4 and 2 tie at 300 samples: 2 is taken; 20 clients, so 2 of them: 9 (the largest) and 2.
    sizes = {i: 100 for i in range(20)} | {9: 400, 4: 300, 2: 300}
    results = {i: EvalResult(5, 10, 0.0) for i in range(20)} | {2: EvalResult(1, 4, 0.0), 4: EvalResult(4, 4, 0.0)}
    results[9] = EvalResult(6, 6, 0.0)
    assert largest_clients(sizes, range(20)) == [9, 2]
    assert largest_clients(sizes, reversed(range(20))) == [9, 2]  # whatever order the clients come in
    assert largest_accuracy(results, sizes) == pytest.approx((6 + 1) / (6 + 4))
    # 1..10 clients: ⌈10 %⌉ is one client, the largest (0 of 0 and 1, tied; 2 of 2 and 4, tied; then 9).
    for n, largest in zip(range(1, 11), [0, 0, 2, 2, 2, 2, 2, 2, 2, 9]):
        few = {i: results[i] for i in range(n)}
        assert largest_clients(sizes, few) == [largest], n
        assert largest_accuracy(few, sizes) == pytest.approx(few[largest].accuracy), n
    assert largest_clients(sizes, range(11)) == [9, 2]  # ⌈1.1⌉ = 2


def test_largest10_skips_clients_without_test_samples_and_needs_every_size():
    sizes = {0: 1000, 1: 10, 2: 20, 3: 30}
    results = {0: EvalResult(0, 0, float("nan")), 1: EvalResult(1, 2, 0.0), 2: EvalResult(2, 4, 0.0)}
    results[3] = EvalResult(3, 3, 0.0)
    assert largest_accuracy(results, sizes) == pytest.approx(1.0)  # client 3: client 0 has no test split
    with pytest.raises(ValueError, match=r"no sample count for clients \[3\]"):
        largest_accuracy(results, {0: 1000, 1: 10, 2: 20})
    assert largest_accuracy(results, {1: 10, 2: 20, 3: 30}) == pytest.approx(1.0)  # client 0 needs no size
    with pytest.raises(ValueError, match="no client test samples"):
        largest_accuracy({0: EvalResult(0, 0, float("nan"))}, sizes)


def test_a_short_run_writes_largest10_accuracy_of_its_largest_client(digits_config, capsys):
    config = digits_config()
    run_dir, summary = run_experiment(config)
    assert summary["status"] == "completed"
    data = load_federated_data(config.data, config.federation.seed)
    sizes = [c.num_train + c.num_test for c in data.clients]
    largest = sizes.index(max(sizes))  # 5 clients: ⌈10 %⌉ is the one largest (the lowest id on a tie)
    rows, clients = read_csv(run_dir / "metrics.csv"), read_csv(run_dir / "clients.csv")
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        assert 0 <= row["largest10_accuracy"] <= 1
        (own,) = [c for c in clients if c["round"] == row["round"] and c["client"] == largest]
        assert row["largest10_accuracy"] == pytest.approx(own["correct"] / own["num_test"])
    header = (run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header.index("largest10_accuracy") == header.index("worst10_accuracy") + 1

    assert summary["final_largest10_accuracy"] == rows[-1]["largest10_accuracy"]
    assert summary["final_worst10_accuracy"] == rows[-1]["worst10_accuracy"]

    capsys.readouterr()
    assert main(["compare", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"| {summary['method']} | {100 * summary['best_accuracy']:.2f} (n=1) |" in out
    final = [100 * rows[-1][k] for k in ("accuracy", "worst10_accuracy", "largest10_accuracy")]
    assert " | ".join(f"{v:.2f}" for v in final) + " | 1 |" in out


@pytest.mark.slow
def test_wandb_offline_run_is_written_quietly_unless_verbose(digits_config, monkeypatch, capfd):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_experiment(digits_config(**{"logger.name": "wandb", "federation.rounds": 0, "logger.verbose": True}))
    assert "wandb: " in capfd.readouterr().err  # W&B's banners, on request
    run_dir, summary = run_experiment(digits_config(**{"logger.name": "wandb", "federation.rounds": 1}))
    lines = capfd.readouterr().err.lower().splitlines()  # the run directory's path names the test, wandb included
    assert not [line for line in lines if "wandb" in line and not line.startswith("run directory: ")]  # no banner
    offline_runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline_runs) == 1 and offline_runs[0].stat().st_size > 0
    assert (run_dir / "metrics.csv").is_file()  # plfl's own files are written too
    assert summary["status"] == "completed"

    run_id = (run_dir / "wandb_run_id").read_text()
    run_experiment(resume_config(run_dir, ["federation.rounds=2"]), run_dir)
    assert (run_dir / "wandb_run_id").read_text() == run_id  # the resumed run logs to the same W&B run
    assert all(run_id.strip() in p.name for p in (run_dir / "wandb").glob("offline-run-*"))


@pytest.mark.slow
def test_wandb_receives_accuracy_histogram_and_method_panels(digits_config, monkeypatch):
    """What the W&B dashboards plot: per-round metrics against ``round``, the client accuracy histogram,
    and each method's own panels (ALA weights, Self-FL's σ's and l_m, pFedLA's weight table, bytes)."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged = []
    log = wandb.sdk.wandb_run.Run.log
    monkeypatch.setattr(
        wandb.sdk.wandb_run.Run, "log", lambda self, data, *a, **k: (logged.append(data), log(self, data, *a, **k))
    )
    expected = {
        "fedala": {"ala_weight_mean", "ala_weight_std", "ala_weight_zero_fraction", "ala_epochs_mean"},
        "selffl": {
            "selffl_sigma0_sq",
            "selffl_sigma_sq_mean",
            "selffl_local_steps_mean",
            "selffl_rule_steps_median",
            "selffl_clients",
        },
        "pfedla": {"self_weight_mean", "aggregation_weights"},
    }
    options = {"selffl": {"method.warmup_rounds": 0, "method.l_max": 5}}
    for method, keys in expected.items():
        logged.clear()
        run_experiment(digits_config(**{"logger.name": "wandb", "method.name": method, **options.get(method, {})}))
        assert [row["round"] for row in logged] == [0, 1, 2, 3]
        last = logged[-1]
        expected_keys = {"accuracy", "worst10_accuracy", "largest10_accuracy", "bytes_sent", "bytes_received"}
        assert keys | expected_keys <= set(last), method
        assert isinstance(last["client_accuracy"], wandb.Histogram)
        table = last.get("aggregation_weights") or last.get("selffl_clients")
        if table is not None:
            assert isinstance(table, wandb.Table) and len(table.data) > 0
    assert logged[-1]["aggregation_weights"].columns[:3] == ["client", "layer", "retained"]


def test_a_stopped_run_is_marked_preempted_in_wandb_and_ends_with_the_signals_status():
    from plfl.callbacks import WandbRun

    class Run:  # what WandbRun uses of a W&B run
        def __init__(self):
            self.summary, self.calls = {}, []

        def mark_preempting(self):
            self.calls.append("mark_preempting")

        def finish(self, exit_code=0):
            self.calls.append(f"finish({exit_code})")

    callback = WandbRun("plfl")
    callback.experiment = Run()
    callback.on_fit_error(None, {"status": "interrupted", "signal": "SIGTERM", "rounds": 3})
    assert callback.experiment.calls == ["mark_preempting", "finish(143)"]
    assert callback.experiment.summary["status"] == "interrupted"
    callback.experiment = Run()
    callback.on_fit_error(None, {"status": "failed", "error": "RuntimeError: x"})
    assert callback.experiment.calls == ["finish(1)"]
