"""plfl sweep: W&B sweep files run offline trial by trial, with results tables, resumption and clear errors."""

import csv
import json
import math
import os
import signal
from pathlib import Path
from typing import Optional

import pytest
import yaml
from omegaconf import OmegaConf

import plfl.experiment
from plfl.callbacks import FederationCallback
from plfl.cli import main
from plfl.errors import ConfigError
from plfl.sweep import SEARCH_METHODS, run_sweep

ROOT = Path(__file__).resolve().parents[1]
GRID = {"federation.lr": {"values": [0.01, 0.1]}, "method.name": {"values": ["fedavg", "local"]}}
COMBINATIONS = {(0.01, "fedavg"), (0.01, "local"), (0.1, "fedavg"), (0.1, "local")}
LOG_LR = {"distribution": "log_uniform_values", "min": 0.001, "max": 0.1}


def write_sweep(tmp_path: Path, parameters=GRID, command_args=("${args_no_hyphens}",), **keys) -> Path:
    """A sweep file whose command runs a tiny digits config (2 clients, MLP, 3 rounds) with output in tmp_path/out."""
    config = {
        "output_dir": str(tmp_path / "out"),
        "progress_bar": False,
        "data": {"source": "digits", "num_clients": 2, "beta": 0.5},
        "model": {"name": "mlp", "hidden_sizes": [16]},
        "federation": {"rounds": 3, "lr": 0.05, "batch_size": 50},
    }
    (tmp_path / "digits.yaml").write_text(yaml.safe_dump(config))
    sweep = {
        "method": "grid",
        "metric": {"name": "best_accuracy", "goal": "maximize"},
        "parameters": parameters,
        "command": ["${env}", "plfl", "fit", "--config", str(tmp_path / "digits.yaml"), *command_args],
        **keys,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return path


def rows(tmp_path: Path) -> list[dict]:
    with open(tmp_path / "out" / "sweeps" / "sweep" / "results.csv") as f:
        return list(csv.DictReader(f))


def run_dirs(tmp_path: Path) -> set[Path]:
    return {p.parent for p in (tmp_path / "out").glob("*/*/config.yaml")}


def recorded_trials(tmp_path: Path) -> list[dict]:
    """The trials in the sweep's trials.json."""
    return json.loads((tmp_path / "out" / "sweeps" / "sweep" / "trials.json").read_text())["trials"]


def lr_search(method: str, values=(0.01, 0.1)) -> dict:
    """The sweep's parameters: federation.lr over ``values`` for a grid, log-uniform over [0.001, 0.1] else."""
    return {"federation.lr": {"values": list(values)} if method == "grid" else LOG_LR}


def ctrl_c_after_round(monkeypatch, round_: Optional[int]) -> None:
    """Makes the next run that reaches the end of round ``round_`` (None: the end of the run, its files written)
    send this process SIGINT, as Ctrl+C would (once): the round's files and checkpoint are written, then the run
    and the sweep stop."""
    build_callbacks, sent = plfl.experiment.build_callbacks, []

    class CtrlC(FederationCallback):
        def on_round_end(self, run, result):
            if result.round == round_ and not sent:
                sent.append(run.run_dir)
                os.kill(os.getpid(), signal.SIGINT)

        def on_fit_end(self, run, summary):
            if round_ is None and not sent:
                sent.append(run.run_dir)
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(plfl.experiment, "build_callbacks", lambda cfg, state: [*build_callbacks(cfg, state), CtrlC()])


def fake_training(calls: list, fail=lambda cfg: False, interrupt_at=None):
    """A stand-in for run_experiment: writes config.yaml to its run directory, records the call, scores
    -|log10(lr) + 2|; the ``interrupt_at``-th call is interrupted before it writes anything."""

    def run(cfg, resume=None, run_dir=None):
        calls.append((cfg.federation.lr, cfg.method.name))
        if len(calls) == interrupt_at:
            raise SystemExit(1)  # what Lightning's Trainer raises on Ctrl+C during a fit
        run_dir = resume or run_dir or plfl.experiment.new_run_dir(Path(cfg.output_dir) / cfg.name)
        OmegaConf.save(cfg, run_dir / "config.yaml")
        if fail(cfg):
            raise RuntimeError("diverged")
        score = -abs(math.log10(cfg.federation.lr) + 2)
        return run_dir, {
            "status": "completed",
            "best_accuracy": score,
            "final_accuracy": score - 1,
            "seconds_per_round": 0.5,
        }

    return run


def test_grid_sweep_runs_every_combination_and_reruns_only_a_deleted_trial(tmp_path, capsys):
    path = write_sweep(tmp_path)
    assert main(["sweep", str(path), "federation.rounds=1"]) == 0
    table = rows(tmp_path)
    assert {(float(r["federation.lr"]), r["method.name"]) for r in table} == COMBINATIONS
    for row in table:
        run_dir = Path(row["run_dir"])
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["rounds"] == 1  # the command-line override reached every trial
        for key in ("best_accuracy", "final_accuracy", "seconds_per_round"):
            assert float(row[key]) == summary[key], key
        config = OmegaConf.load(run_dir / "config.yaml")
        assert (config.federation.lr, config.method.name) == (float(row["federation.lr"]), row["method.name"])
    best = max(table, key=lambda r: float(r["best_accuracy"]))
    out = capsys.readouterr().out
    assert f"Best best_accuracy: {float(best['best_accuracy']):.4g} (trial {best['trial']}:" in out
    assert len((tmp_path / "out" / "sweeps" / "sweep" / "results.md").read_text().splitlines()) == 2 + 4

    state_file = tmp_path / "out" / "sweeps" / "sweep" / "trials.json"
    state = json.loads(state_file.read_text())
    removed = state["trials"].pop(1)
    state_file.write_text(json.dumps(state))
    before = run_dirs(tmp_path)
    assert main(["sweep", str(path), "--count", "4", "federation.rounds=1"]) == 0  # overrides after --count too
    (new_dir,) = run_dirs(tmp_path) - before
    config = OmegaConf.load(new_dir / "config.yaml")
    assert {"federation.lr": config.federation.lr, "method.name": config.method.name} == removed["parameters"]
    table_again = rows(tmp_path)
    assert {(float(r["federation.lr"]), r["method.name"]) for r in table_again} == COMBINATIONS
    assert {r["run_dir"] for r in table_again} == {r["run_dir"] for r in table} - {removed["run_dir"]} | {str(new_dir)}

    before = run_dirs(tmp_path)
    assert main(["sweep", str(path), "federation.rounds=1"]) == 0  # the grid is exhausted: nothing runs
    assert run_dirs(tmp_path) == before


def test_an_override_of_a_constant_parameter_is_the_value_every_trial_runs_and_shows(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(plfl.experiment, "run_experiment", fake_training(calls))
    path = write_sweep(tmp_path, {"federation.lr": {"values": [0.01, 0.1]}, "method.name": {"value": "fedavg"}})
    run_sweep(path, ["method.name=local"])
    assert calls == [(0.01, "local"), (0.1, "local")]
    assert [r["method.name"] for r in rows(tmp_path)] == ["local", "local"]
    with pytest.raises(ConfigError, match="'federation.lr=0.5' sets a parameter that .* sweeps"):
        run_sweep(path, ["federation.lr=0.5"])


def test_an_interrupted_sweep_continues_and_a_failing_trial_is_recorded(tmp_path, monkeypatch, capsys):
    path = write_sweep(tmp_path)
    calls = []
    monkeypatch.setattr(plfl.experiment, "run_experiment", fake_training(calls, interrupt_at=3))
    assert main(["sweep", str(path)]) == 130
    assert "interrupted; finished trials are saved; run the same command again" in capsys.readouterr().err
    # Saved before the interruption; the interrupted trial is known, with its parameters.
    assert [r["status"] for r in rows(tmp_path)] == ["completed", "completed", "running"]

    calls.clear()
    failing = fake_training(calls, fail=lambda cfg: cfg.federation.lr == 0.1 and cfg.method.name == "local")
    monkeypatch.setattr(plfl.experiment, "run_experiment", failing)
    assert main(["sweep", str(path)]) == 1
    assert sorted(calls) == [(0.1, "fedavg"), (0.1, "local")]  # only what the interruption left
    failed = [r for r in rows(tmp_path) if r["status"] == "failed"]
    assert [(r["federation.lr"], r["method.name"], r["error"], r["best_accuracy"]) for r in failed] == [
        ("0.1", "local", "RuntimeError: diverged", "")
    ]
    assert (Path(failed[0]["run_dir"]) / "config.yaml").is_file()  # the failed trial's own run directory
    assert "1 of 4 trials failed" in capsys.readouterr().err

    calls.clear()
    monkeypatch.setattr(plfl.experiment, "run_experiment", fake_training(calls))
    assert main(["sweep", str(path), "--retry-failed"]) == 0
    assert calls == [(0.1, "local")]
    assert [r["status"] for r in rows(tmp_path)] == ["completed"] * 4


def test_bayes_and_random_sweeps_stop_at_the_count_of_all_trials(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(plfl.experiment, "run_experiment", fake_training(calls))
    lr = {"distribution": "log_uniform_values", "min": 0.001, "max": 0.1}
    path = write_sweep(tmp_path, {"federation.lr": lr}, method="bayes")
    result = run_sweep(path, count=3)
    assert len(calls) == 3 and all(0.001 <= lr <= 0.1 for lr, _ in calls)
    assert all(type(t["parameters"]["federation.lr"]) is float for t in result.trials)  # not NumPy scalars
    everything = run_sweep(path, count=5)
    assert len(everything.trials) == 5 and len(calls) == 5  # --count counts the earlier invocation's trials
    best = max(calls, key=lambda c: -abs(math.log10(c[0]) + 2))
    assert everything.best()["parameters"] == {"federation.lr": best[0]}

    for name, cap in (("capped", {"run_cap": 2}), ("endless", {})):
        (tmp_path / name).mkdir()
        write_sweep(tmp_path / name, {"federation.lr": lr}, method="random", **cap)
    assert len(run_sweep(tmp_path / "capped" / "sweep.yaml").trials) == 2  # run_cap is the default count
    with pytest.raises(ConfigError, match="never ends by itself; pass --count N or set run_cap"):
        run_sweep(tmp_path / "endless" / "sweep.yaml")


@pytest.mark.parametrize("method", ["random", pytest.param("bayes", marks=pytest.mark.slow)])
def test_trials_run_in_this_process_do_not_repeat_the_engines_draws(tmp_path, method):
    """A trial reseeds Python's and NumPy's global generators (federation.seed), which the engine draws its
    proposals from: every trial still gets new parameters, and the same sweep proposes the same ones again."""
    proposals = []
    for copy in ("one", "two"):
        (tmp_path / copy).mkdir()
        path = write_sweep(tmp_path / copy, lr_search(method), method=method, run_cap=3)
        result = run_sweep(path, ["federation.rounds=1"])
        proposals.append([t["parameters"]["federation.lr"] for t in result.trials])
    assert len(set(proposals[0])) == 3 and proposals[1] == proposals[0]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"parameters": None}, "'parameters' is a required property"),
        ({"method": "annealing"}, "'annealing' is not one of ['bayes', 'random', 'grid', 'custom']"),
        (
            {"parameters": {"method.zz": {"values": [1, 2]}}},
            "parameter method.zz = 1 does not give a valid config: Unknown config key 'method.zz'",
        ),
        ({"parameters": {"method.name": {"values": ["fedavg", "fedxyz"]}}}, "Unknown method.name 'fedxyz'"),
        ({"parameters": {"federation.lr": {"values": [0.1, 0.0]}}}, "'federation.lr' must be a number > 0; got 0.0"),
        ({"command_args": ()}, "the command lacks ${args_no_hyphens}, so wandb agent would not pass the parameters"),
        ({"command_args": ("${args}",)}, "command argument '${args}' is not --config"),
    ],
)
def test_a_bad_sweep_file_is_a_clear_error_before_any_trial(tmp_path, monkeypatch, change, message):
    calls = []
    monkeypatch.setattr(plfl.experiment, "run_experiment", fake_training(calls))
    keys = {"parameters": GRID, **change}
    path = write_sweep(tmp_path, **keys)
    if keys["parameters"] is None:
        data = yaml.safe_load(path.read_text())
        del data["parameters"]
        path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as error:
        run_sweep(path)
    assert message in str(error.value)
    assert calls == [] and not (tmp_path / "out").exists()


def test_bad_input_on_the_command_line_exits_2_with_one_paragraph(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plfl.experiment, "run_experiment", fake_training([]))
    path = write_sweep(tmp_path)
    assert main(["sweep", str(path), "method.name=local"]) == 2
    assert capsys.readouterr().err.strip() == (
        "plfl sweep: 'method.name=local' sets a parameter that "
        f"{path} sweeps; remove it from the command line "
        "or from the file's command."
    )
    assert main(["sweep", str(path), "--count", "1"]) == 0
    assert main(["sweep", str(path), "federation.rounds=1"]) == 2  # the sweep directory holds other overrides
    assert "holds trials of a different sweep (changed: overrides)" in capsys.readouterr().err


def test_a_metric_missing_from_summary_json_stops_the_sweep_naming_the_valid_ones(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(plfl.experiment, "run_experiment", fake_training(calls))
    path = write_sweep(tmp_path, metric={"name": "val_acc", "goal": "maximize"})
    with pytest.raises(
        ConfigError,
        match="metric 'val_acc' is not in summary.json .*; use one of best_accuracy, final_accuracy, seconds_per_round",
    ):
        run_sweep(path)
    assert len(calls) == 1


@pytest.mark.slow
@pytest.mark.parametrize("sweep_file", sorted((ROOT / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_the_shipped_sweep_files_load_and_propose_valid_trials(sweep_file, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(plfl.experiment, "run_experiment", fake_training(calls))
    monkeypatch.chdir(ROOT)  # their --config paths are relative to the repository, as for wandb agent
    result = run_sweep(sweep_file, [f"output_dir={tmp_path}"], count=1)
    assert len(calls) == 1 and result.trials[0]["status"] == "completed"
    assert (result.sweep.metric, result.sweep.goal) == ("best_accuracy", "maximize")
    assert "logger.name=wandb" in result.sweep.overrides  # so that the online agent's runs report to W&B


@pytest.mark.slow
@pytest.mark.parametrize("method", SEARCH_METHODS)
def test_a_trial_stopped_by_a_signal_continues_from_its_checkpoint_with_its_parameters(
    tmp_path, monkeypatch, capsys, method
):
    path = write_sweep(tmp_path, lr_search(method), method=method, run_cap=2)
    ctrl_c_after_round(monkeypatch, 1)
    assert main(["sweep", str(path), "federation.rounds=2"]) == 130
    (stopped,) = recorded_trials(tmp_path)  # recorded when it started
    run_dir, lr = Path(stopped["run_dir"]), stopped["parameters"]["federation.lr"]
    assert stopped["status"] == "running" and (run_dir / "checkpoints" / "round-00001.pt").is_file()
    first_rounds = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(first_rounds) == 1 + 2  # the header, rounds 0 and 1

    assert main(["sweep", str(path), "federation.rounds=2"]) == 0
    assert f"Trial 1: federation.lr={lr} (continues {run_dir} from its newest checkpoint)" in capsys.readouterr().out
    resumed, other = recorded_trials(tmp_path)
    assert (resumed["trial"], resumed["parameters"], resumed["run_dir"]) == (1, stopped["parameters"], str(run_dir))
    assert resumed["status"] == other["status"] == "completed"
    metrics = (run_dir / "metrics.csv").read_text().splitlines()
    assert metrics[:3] == first_rounds and len(metrics) == 1 + 3  # rounds 0 and 1 kept, not trained again
    assert OmegaConf.load(run_dir / "config.yaml").federation.lr == lr
    assert json.loads((run_dir / "summary.json").read_text())["best_accuracy"] == resumed["metrics"]["best_accuracy"]
    if method == "grid":  # the engine does not propose the continued trial's parameters again
        assert {resumed["parameters"]["federation.lr"], other["parameters"]["federation.lr"]} == {0.01, 0.1}
    assert run_dirs(tmp_path) == {run_dir, Path(other["run_dir"])}


@pytest.mark.parametrize("method", ["grid", *(pytest.param(m, marks=pytest.mark.slow) for m in ("random", "bayes"))])
def test_a_trial_stopped_before_its_first_checkpoint_starts_again_with_its_parameters(tmp_path, monkeypatch, method):
    calls = []
    monkeypatch.setattr(plfl.experiment, "run_experiment", fake_training(calls, interrupt_at=2))
    path = write_sweep(tmp_path, lr_search(method, (0.001, 0.01, 0.1)), method=method, run_cap=3)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(path)
    stopped = recorded_trials(tmp_path)[1]
    assert stopped["status"] == "running" and stopped["parameters"] == {"federation.lr": calls[1][0]}
    assert list(Path(stopped["run_dir"]).iterdir()) == []  # its run wrote nothing

    calls.clear()
    monkeypatch.setattr(plfl.experiment, "run_experiment", fake_training(calls))
    result = run_sweep(path)
    assert calls[0][0] == stopped["parameters"]["federation.lr"] and len(calls) == 2
    again = result.trials[1]
    assert (again["trial"], again["parameters"], again["status"]) == (2, stopped["parameters"], "completed")
    # Its empty run directory made way for a new one; every run directory is a trial's, with its files.
    assert set((tmp_path / "out" / "fedavg-digits").iterdir()) == run_dirs(tmp_path)
    assert {Path(t["run_dir"]) for t in result.trials} == run_dirs(tmp_path)
    assert len({t["parameters"]["federation.lr"] for t in result.trials}) == 3


@pytest.mark.slow
def test_a_trial_whose_run_completed_before_the_sweep_recorded_it_is_taken_as_it_is(tmp_path, monkeypatch):
    path = write_sweep(tmp_path, lr_search("grid"))
    ctrl_c_after_round(monkeypatch, None)
    assert main(["sweep", str(path), "federation.rounds=1"]) == 130
    (stopped,) = recorded_trials(tmp_path)
    run_dir = Path(stopped["run_dir"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (stopped["status"], summary["status"]) == ("running", "completed")
    metrics = (run_dir / "metrics.csv").read_text()

    assert main(["sweep", str(path), "federation.rounds=1"]) == 0
    first, second = recorded_trials(tmp_path)
    assert (first["status"], first["run_dir"]) == ("completed", str(run_dir))
    assert first["metrics"]["best_accuracy"] == summary["best_accuracy"]
    assert (run_dir / "metrics.csv").read_text() == metrics  # not run again
    assert second["status"] == "completed" and second["parameters"] != first["parameters"]
