"""Federation metrics checked by hand, and W&B logging in offline mode."""

import pytest

from plfl.config import resume_config
from plfl.experiment import run_experiment
from plfl.metrics import federation_metrics
from plfl.tasks import EvalResult


def test_federation_metrics_by_hand():
    results = {
        i: EvalResult(c, n, loss)
        for i, (c, n, loss) in enumerate(
            [(9, 10, 0.1), (1, 10, 0.5), (30, 40, 0.2)] + [(5, 10, 1.0)] * 7 + [(0, 0, float("nan"))]
        )
    }
    m = federation_metrics(results)
    assert m["accuracy"] == pytest.approx((9 + 1 + 30 + 35) / (10 + 10 + 40 + 70))
    per_client = [0.9, 0.1, 0.75] + [0.5] * 7  # the client without test samples is left out
    assert m["client_accuracy_mean"] == pytest.approx(sum(per_client) / 10)
    assert m["worst10_accuracy"] == pytest.approx(0.1)  # ⌈10 % of 10⌉ = 1 client
    assert m["test_loss"] == pytest.approx((1 + 5 + 8 + 70) / 130)


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
        assert keys | {"accuracy", "worst10_accuracy", "bytes_sent", "bytes_received"} <= set(last), method
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
