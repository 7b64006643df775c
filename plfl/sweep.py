"""Offline W&B sweeps: ``plfl sweep sweeps/X.yaml [--count N] [key=value ...]``.

A sweep file is an ordinary W&B sweep (``wandb sweep`` + ``wandb agent`` run it
online). Here W&B's own search engine, the ``sweeps`` package, proposes each
trial (grid, random or bayes) with no server; the trial runs in this process
exactly as ``plfl fit --config <the command's config> <the command's key=value
args> <trial parameters> <extra overrides>`` would, and its summary metric goes
back to the engine. The sweep directory ``<output_dir>/sweeps/<file stem>/``
holds ``trials.json`` (the state, rewritten when a trial starts and when it
ends, from which an interrupted sweep continues: its running trials first,
with their parameters and run directories), ``results.csv`` and
``results.md``. With ``--parallel N`` up to N trials run at once, each as a
Ray task (one CPU, its own worker process) on a Ray started on this machine;
the engine proposes each new trial knowing the running ones, so a grid never
proposes one twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import yaml

from plfl.callbacks.files import csv_text, write_atomically
from plfl.cluster import connect, import_ray, wait
from plfl.config import load_config, read_yaml, resume_config
from plfl.errors import ConfigError, PlflError

with warnings.catch_warnings():
    # sweeps 0.2.0 declares pydantic-v1 config keys; pydantic 2 warns on import, harmlessly.
    warnings.simplefilter("ignore")
    import sweeps
    from sweeps import RunState, SweepRun

SEARCH_METHODS = ("grid", "random", "bayes")
# summary.json keys every results table shows, beside the sweep's own metric.
SUMMARY_COLUMNS = ("best_accuracy", "final_accuracy", "seconds_per_round")
# Distributions whose min and max are parameter values (log_uniform's are exponents).
VALUE_BOUNDED = ("int_uniform", "uniform", "q_uniform", "log_uniform_values", "q_log_uniform_values")
EXAMPLE_COMMAND = 'command: ["${env}", plfl, fit, --config, configs/X.yaml, "${args_no_hyphens}"]'


@dataclass
class Sweep:
    """A parsed sweep file.

    ``search`` is the file without ``run_cap`` (W&B's key, absent from the
    engine's schema); ``config_path`` and ``overrides`` come from its command.
    """

    path: Path
    search: dict[str, Any]
    run_cap: Optional[int]
    config_path: str
    overrides: list[str]

    @property
    def metric(self) -> Optional[str]:
        return self.search.get("metric", {}).get("name")

    @property
    def goal(self) -> str:
        return self.search.get("metric", {}).get("goal", "minimize")  # W&B's default


@dataclass
class SweepResult:
    """Every trial in the sweep directory, earlier invocations' included, in trial order."""

    sweep: Sweep
    sweep_dir: Path
    trials: list[dict[str, Any]]

    def rows(self) -> list[dict[str, Any]]:
        """One flat row per trial: trial, parameters, metrics, status, run_dir, error."""
        return [
            {
                "trial": t["trial"],
                **t["parameters"],
                **t["metrics"],
                "status": t["status"],
                "run_dir": t["run_dir"],
                "error": t["error"],
            }
            for t in self.trials
        ]

    def best(self) -> Optional[dict[str, Any]]:
        """The completed trial with the best value of the sweep's metric (None without one)."""
        metric = self.sweep.metric
        scored = [t for t in self.trials if t["status"] == "completed" and t["metrics"].get(metric) is not None]
        if not scored:
            return None
        pick = max if self.sweep.goal == "maximize" else min
        return pick(scored, key=lambda t: t["metrics"][metric])


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a W&B sweep file for an offline run.

    Raises:
        ConfigError: the file is missing or not YAML; it breaks W&B's sweep
            schema (e.g. no ``parameters``, an unknown ``method``); its search
            method is not grid, random or bayes; ``run_cap`` is not a positive
            integer; or its ``command`` does not run ``plfl fit --config X``
            with ``${args_no_hyphens}``.
    """
    path = Path(path)
    data = read_yaml(path, f"Sweep file {path} does not exist. Pass an existing W&B sweep YAML (see sweeps/).")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping with method, metric, parameters and command.")
    data = dict(data)
    run_cap = data.pop("run_cap", None)
    if run_cap is not None and (not isinstance(run_cap, int) or isinstance(run_cap, bool) or run_cap < 1):
        raise ConfigError(f"{path}: run_cap must be an integer >= 1; got {run_cap!r}.")
    try:
        violations = sweeps.schema_violations_from_proposed_config(data)
    except ValueError as e:  # a parameter that is not a mapping
        violations = [str(e)]
    if violations:
        raise ConfigError(
            f"{path} is not a valid W&B sweep file: {'; '.join(violations)}. "
            "See https://docs.wandb.ai/guides/sweeps/sweep-config-keys."
        )
    if data["method"] not in SEARCH_METHODS:
        raise ConfigError(
            f"{path}: method {data['method']!r} needs W&B's server; plfl sweep runs {', '.join(SEARCH_METHODS)}."
        )
    if data["method"] == "bayes" and "metric" not in data:
        raise ConfigError(f"{path}: bayes search needs a metric, e.g. metric: {{name: best_accuracy, goal: maximize}}.")
    config_path, overrides = parse_command(data, path)
    return Sweep(path, data, run_cap, config_path, overrides)


def parse_command(search: dict[str, Any], path: Path) -> tuple[str, list[str]]:
    """The ``--config`` file and the fixed ``key=value`` args of the sweep's ``plfl fit`` command.

    Macros expand as ``wandb agent`` expands them; paths stay relative to the
    current directory, as they are for the agent.

    Raises:
        ConfigError: no command, not ``plfl fit``, no ``--config``, no
            ``${args_no_hyphens}``, or another argument plfl cannot pass on.
    """
    command = search.get("command")
    if not command:
        raise ConfigError(f"{path} has no command; plfl sweep reads the config from one like {EXAMPLE_COMMAND}")
    macros = {"${env}": "/usr/bin/env", "${interpreter}": "python", "${program}": str(search.get("program"))}
    envvar = re.compile(r"\$\{envvar:([A-Z0-9_]*)\}")
    tokens = [macros.get(t, envvar.sub(lambda m: os.environ.get(m.group(1), m.group(1)), t)) for t in map(str, command)]
    if "fit" not in tokens or not any("plfl" in t for t in tokens[: tokens.index("fit")]):
        raise ConfigError(f"{path}: the command {' '.join(tokens)} does not run plfl fit; write {EXAMPLE_COMMAND}")
    config_path, overrides, passes_parameters = None, [], False
    rest = iter(tokens[tokens.index("fit") + 1 :])
    for token in rest:
        if token in ("--config", "-c"):
            config_path = next(rest, None)
        elif token.startswith("--config="):
            config_path = token.removeprefix("--config=")
        elif token == "${args_no_hyphens}":
            passes_parameters = True
        elif "=" in token and not token.startswith(("-", "$")):
            overrides.append(token)
        else:
            raise ConfigError(
                f"{path}: command argument {token!r} is not --config, a key=value override or "
                "${args_no_hyphens}; plfl fit takes parameters as key=value (use ${args_no_hyphens})."
            )
    if config_path is None:
        raise ConfigError(f"{path}: the command has no --config; write {EXAMPLE_COMMAND}")
    if not passes_parameters:
        raise ConfigError(
            f"{path}: the command lacks ${{args_no_hyphens}}, so wandb agent would not pass the "
            f"parameters; write {EXAMPLE_COMMAND}"
        )
    return config_path, overrides


def run_sweep(
    path: str | Path,
    overrides: list[str] = (),
    count: Optional[int] = None,
    retry_failed: bool = False,
    echo: Callable[[str], None] = print,
    parallel: int = 1,
) -> SweepResult:
    """Run the sweep's remaining trials and write the sweep directory after each one.

    Args:
        path: the W&B sweep file.
        overrides: ``key=value`` applied to every trial (after the command's own).
        count: stop once the sweep directory holds this many trials, earlier
            invocations' included (default: the file's ``run_cap``; a grid
            also stops when exhausted).
        retry_failed: forget failed trials so that the engine proposes again.
        echo: where a line per trial goes.
        parallel: how many trials run at once; above 1 each runs as a Ray task on a Ray started on this
            machine with ``parallel`` CPUs (or on the Ray this process is connected to).

    Each trial is recorded (status ``running``, parameters, run directory) before it starts. A trial that
    raises is recorded as failed with its error and the sweep goes on; a stopping signal
    (:class:`plfl.stopping.Stopped`) or KeyboardInterrupt stops it with the running trials stopped and still
    recorded as running. An invocation first finishes the trials an earlier one left running, with their
    parameters: from the newest checkpoint in their run directory as ``plfl fit --resume`` does, or, without
    one, from the start in a new run directory. Only then does the engine propose new trials.

    Raises:
        ConfigError: a bad sweep file (see :func:`load_sweep`), a bad config or
            override, an override of a swept parameter, a parameter value the
            config rejects (an override of a constant ``value:`` parameter replaces
            its value instead), a random/bayes sweep with no count, a sweep
            directory holding a different sweep, a metric not in summary.json, ``parallel`` below 1,
            or ``parallel`` above 1 without Ray installed or with ``federation.executor=ray`` trials.
    """
    sweep = load_sweep(path)
    count = count if count is not None else sweep.run_cap
    if count is not None and count < 1:
        raise ConfigError(f"--count must be >= 1; got {count}.")
    if parallel < 1:
        raise ConfigError(f"--parallel must be >= 1; got {parallel}.")
    ray = import_ray("plfl sweep --parallel") if parallel > 1 else None
    if count is None and sweep.search["method"] != "grid":
        raise ConfigError(
            f"{sweep.path}: a {sweep.search['method']} search never ends by itself; "
            "pass --count N or set run_cap in the file."
        )
    fixed = sweep.overrides + _set_constant_parameters(sweep, list(overrides))
    for override in fixed:
        if override.split("=", 1)[0].strip() in sweep.search["parameters"]:
            raise ConfigError(
                f"{override!r} sets a parameter that {sweep.path} sweeps; remove it from the "
                "command line or from the file's command."
            )
    if not Path(sweep.config_path).is_file():
        raise ConfigError(
            f"{sweep.path}: the command's config {sweep.config_path} does not exist; relative paths "
            "start at the current directory, as for wandb agent (run from the repository root)."
        )
    base = load_config(sweep.config_path, fixed)
    _check_parameter_values(sweep, fixed)
    if ray is not None and base.federation.executor == "ray":
        raise ConfigError(
            "plfl sweep --parallel runs each trial as one Ray task, so its trials cannot start Ray "
            "actors of their own: drop --parallel or use another federation.executor."
        )

    sweep_dir = Path(base.output_dir) / "sweeps" / sweep.path.stem
    identity = _normalized(
        {
            "config": sweep.config_path,
            "overrides": fixed,
            **{k: sweep.search.get(k) for k in ("method", "metric", "parameters")},
        }
    )
    trials = _load_trials(sweep_dir, identity)
    if retry_failed:
        trials = [t for t in trials if t["status"] != "failed"]
    unfinished = [t for t in trials if t["status"] == "running"]  # left by an interrupted or killed invocation
    runner = (
        RayTrials(ray, parallel, sweep.metric, sweep.path)
        if ray is not None
        else InProcessTrials(sweep.metric, sweep.path)
    )
    try:
        while True:
            while len(runner.running) < parallel:
                if unfinished:
                    trial = unfinished.pop(0)
                    args = [_arg(k, v) for k, v in trial["parameters"].items()]
                    resume = _has_checkpoint(trial["run_dir"])
                    if resume:
                        note = f" (continues {trial['run_dir']} from its newest checkpoint)"
                    else:
                        _unless_empty(trial["run_dir"])  # one holding the interrupted run's files stays
                        trial["run_dir"] = _new_run_dir(sweep, fixed + args)
                        note = " (again from the start: its run left no checkpoint)"
                elif count is None or len(trials) < count:
                    number = max((t["trial"] for t in trials), default=0) + 1
                    parameters = _propose(sweep, trials, number)
                    if parameters is None:
                        break
                    args = [_arg(k, v) for k, v in parameters.items()]
                    trial = _running(sweep, number, parameters, _new_run_dir(sweep, fixed + args))
                    trials.append(trial)
                    resume, note = False, ""
                else:
                    break
                echo(f"Trial {trial['trial']}: {' '.join(args)}{note}")
                # Recorded before it runs, so that the next invocation finishes it if this one is stopped or killed.
                _save(sweep_dir, identity, SweepResult(sweep, sweep_dir, trials))
                runner.submit(trial["trial"], sweep.config_path, fixed + args, trial["run_dir"], resume)
            if not runner.running:
                break
            number, outcome = runner.next_finished()
            trial = next(t for t in trials if t["trial"] == number)
            trial.update(outcome)
            _save(sweep_dir, identity, SweepResult(sweep, sweep_dir, trials))
            if trial["status"] == "completed":
                m = trial["metrics"]
                echo(
                    f"Trial {number}: best accuracy {100 * m['best_accuracy']:.2f} %, final "
                    f"{100 * m['final_accuracy']:.2f} %, {m['seconds_per_round']:.2f} s per round, "
                    f"{trial['run_dir']}"
                )
            else:
                echo(f"Trial {number} failed: {trial['error']}")
    finally:
        runner.close()
    result = SweepResult(sweep, sweep_dir, trials)
    _save(sweep_dir, identity, result)  # also when nothing ran: the tables exist after every invocation
    return result


def _set_constant_parameters(sweep: Sweep, overrides: list[str]) -> list[str]:
    """Apply each override of a constant parameter (``value:``, e.g. ``method.p=2``) to the sweep itself,
    so that the engine proposes and the results table shows the value used; returns the other overrides."""
    rest = []
    for override in overrides:
        key, _, text = override.partition("=")
        spec = sweep.search["parameters"].get(key.strip())
        if spec is not None and set(spec) == {"value"}:
            spec["value"] = yaml.safe_load(text)
        else:
            rest.append(override)
    return rest


def _running(sweep: Sweep, number: int, parameters: dict[str, Any], run_dir: Optional[str]) -> dict[str, Any]:
    """The record of a trial that starts now (the table's columns of a finished one, empty)."""
    return {
        "trial": number,
        "parameters": parameters,
        "status": "running",
        "metrics": _no_metrics(sweep.metric),
        "run_dir": run_dir,
        "error": None,
    }


def _new_run_dir(sweep: Sweep, overrides: list[str]) -> Optional[str]:
    """A new ``<output_dir>/<name>/<time>/`` for a trial run with ``overrides``, made now so that the sweep
    records it before the trial starts; None when they do not give a valid config (the trial then fails with
    that error)."""
    from plfl.experiment import new_run_dir  # imports torch and Lightning: only once the sweep is checked

    try:
        cfg = load_config(sweep.config_path, overrides)
    except ConfigError:
        return None
    return str(new_run_dir(Path(cfg.output_dir) / cfg.name))


def _has_checkpoint(run_dir: Optional[str]) -> bool:
    """Whether ``run_dir`` holds a checkpoint to continue the trial from."""
    from plfl.checkpoint import list_checkpoints

    return run_dir is not None and bool(list_checkpoints(Path(run_dir) / "checkpoints"))


def _unless_empty(run_dir: Optional[str]) -> Optional[str]:
    """``run_dir`` where it holds files; else None, the empty directory removed (the sweep made it for a trial
    that wrote nothing there)."""
    if run_dir is None:
        return None
    with contextlib.suppress(OSError):  # not empty, or already gone
        Path(run_dir).rmdir()
    return run_dir if Path(run_dir).is_dir() else None


class InProcessTrials:
    """Runs each submitted trial in this process when its result is asked for (``--parallel 1``). A trial is
    ``plfl fit --config config_path overrides`` in ``run_dir``, or its continuation there (``resume``); its key
    (a sweep's trial number, a suite's cell and seed) is any hashable value. ``metric`` (None: none), named in
    the file ``source``, must be in each completed trial's summary.json."""

    def __init__(self, metric: Optional[str], source: Path):
        self.metric, self.source = metric, source
        self.running: dict[Any, tuple[str, list[str], Optional[str], bool]] = {}  # key → config, overrides, ...

    def submit(self, key: Any, config_path: str, overrides: list[str], run_dir: Optional[str], resume: bool) -> None:
        self.running[key] = config_path, overrides, run_dir, resume

    def next_finished(self) -> tuple[Any, dict[str, Any]]:
        """(key, outcome) of the submitted trial, run now."""
        from plfl.experiment import run_experiment

        key, (config_path, overrides, run_dir, resume) = self.running.popitem()
        return key, _run_trial(run_experiment, config_path, overrides, run_dir, resume, self.metric, self.source)

    def close(self) -> None:
        """Nothing runs in the background."""


class RayTrials:
    """Runs each submitted trial as a Ray task (one CPU, a worker process of its own) on a Ray started on this
    machine with ``parallel`` CPUs, or on the one this process is connected to; trials as for
    :class:`InProcessTrials`."""

    def __init__(self, ray: Any, parallel: int, metric: Optional[str], source: Path):
        self.ray, self.metric, self.source = ray, metric, source
        self.started = connect(ray, "local", parallel)
        self.task = ray.remote(num_cpus=1)(_run_trial_in_worker)
        self.running: dict[Any, Optional[str]] = {}  # trial key → run directory
        self.numbers: dict[Any, Any] = {}  # ObjectRef → trial key

    def submit(self, key: Any, config_path: str, overrides: list[str], run_dir: Optional[str], resume: bool) -> None:
        environment = {k: os.environ[k] for k in ("WANDB_MODE",) if k in os.environ}  # the CLI's offline default
        self.numbers[
            self.task.remote(
                os.getcwd(), environment, config_path, overrides, run_dir, resume, self.metric, self.source
            )
        ] = key
        self.running[key] = run_dir

    def next_finished(self) -> tuple[Any, dict[str, Any]]:
        """(key, outcome) of the next trial to finish.

        Raises:
            PlflError: what the trial raised beyond a failed run (a metric missing from summary.json).
        """
        ((ref, trial),) = wait(self.ray, list(self.numbers))
        key = self.numbers.pop(ref)
        if isinstance(trial, self.ray.exceptions.RayTaskError):
            if isinstance(trial.cause, PlflError):
                raise trial.cause from None
            raise trial
        run_dir = self.running.pop(key)
        if isinstance(trial, self.ray.exceptions.RayError):  # its worker process died (e.g. out of memory)
            trial = _failed(
                self.metric, _unless_empty(run_dir), f"{type(trial).__name__}: {str(trial).strip().splitlines()[0]}"
            )
        return key, trial

    def close(self) -> None:
        """Stop the running trials, and Ray if this sweep started it."""
        for ref in self.numbers:
            self.ray.cancel(ref, force=True)
        if self.started:
            self.ray.shutdown()


def _run_trial_in_worker(
    cwd: str,
    environment: dict[str, str],
    config_path: str,
    overrides: list[str],
    run_dir: Optional[str],
    resume: bool,
    metric: Optional[str],
    source: Path,
) -> dict[str, Any]:
    """A trial in a Ray worker, from the sweep's working directory (relative paths) and environment."""
    from plfl.experiment import run_experiment

    os.chdir(cwd)
    os.environ.update(environment)
    return _run_trial(run_experiment, config_path, overrides, run_dir, resume, metric, source)


def _no_metrics(metric: Optional[str]) -> dict[str, None]:
    # Unfinished and failed trials get the same (empty) metric columns, so the table's columns do not depend on
    # which trials completed.
    return dict.fromkeys(SUMMARY_COLUMNS + ((metric,) if metric else ()))


def _failed(metric: Optional[str], run_dir: Optional[str], error: str) -> dict[str, Any]:
    return {"status": "failed", "metrics": _no_metrics(metric), "run_dir": run_dir, "error": error}


def _run_trial(
    run_experiment: Callable,
    config_path: str,
    overrides: list[str],
    run_dir: Optional[str],
    resume: bool,
    metric: Optional[str],
    source: Path,
) -> dict[str, Any]:
    """Run one trial as ``plfl fit --config config_path overrides`` would, in ``run_dir`` (made by the caller;
    None: the overrides do not give a valid config). With ``resume``, continue the run there from its newest
    checkpoint with its own config.yaml, as ``plfl fit --resume run_dir`` does; a run there that completed after
    the caller's last record of it is taken as it is. Any failure becomes ``status: failed`` with the error (and
    ``run_dir``, unless the run wrote nothing there).

    Raises:
        ConfigError: ``metric`` (named in the file ``source``) is not in the run's summary.json.
    """
    try:
        if resume:
            summary_file = Path(run_dir) / "summary.json"
            summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
            if summary.get("status") != "completed":
                _, summary = run_experiment(resume_config(Path(run_dir)), resume=Path(run_dir))
        else:
            cfg = load_config(config_path, overrides)
            made, summary = run_experiment(cfg, run_dir=run_dir and Path(run_dir))
            run_dir = str(made)
    except SystemExit as e:
        # Without plfl's signal handlers (run_sweep called from Python), Lightning's Trainer turns Ctrl+C during a
        # fit into sys.exit(1): stop the sweep, the trial still recorded as running.
        raise KeyboardInterrupt from e
    except Exception as e:  # noqa: BLE001  a failing trial must not end the sweep
        return _failed(metric, _unless_empty(run_dir), f"{type(e).__name__}: {e}")
    if metric is not None and metric not in summary:
        numeric = sorted(k for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        raise ConfigError(
            f"{source}: metric {metric!r} is not in summary.json ({run_dir}); use one of {', '.join(numeric)}."
        )
    return {
        "status": "completed",
        "metrics": {k: summary.get(k) for k in _no_metrics(metric)},
        "run_dir": run_dir,
        "error": None,
    }


def _propose(sweep: Sweep, trials: list[dict[str, Any]], number: int) -> Optional[dict[str, Any]]:
    """The engine's next parameters given the recorded trials, running ones included (a grid skips them, bayes
    treats them as pending), for trial ``number``; None when a grid is exhausted."""
    states = {"completed": RunState.finished, "running": RunState.running, "failed": RunState.failed}
    runs = [
        SweepRun(
            config={k: {"value": v} for k, v in t["parameters"].items()},
            state=states[t["status"]],
            summary_metrics={k: v for k, v in t["metrics"].items() if v is not None},
        )
        for t in trials
    ]
    try:
        with warnings.catch_warnings(), _engine_draws(sweep, number):
            # The Gaussian process of bayes search warns on its fits; its proposals are what count here.
            warnings.simplefilter("ignore")
            run = sweeps.next_run(sweep.search, runs, validate=True)
    except ValueError as e:
        raise ConfigError(f"{sweep.path}: the sweep engine refused the file: {e}.") from None
    return None if run is None else {k: _plain(v["value"]) for k, v in run.config.items()}


@contextlib.contextmanager
def _engine_draws(sweep: Sweep, number: int) -> Iterator[None]:
    """Within the block, Python's and NumPy's global generators, which the engine draws its random and bayes
    proposals from, are seeded from the search (the file's method, metric and parameters) and the trial's
    number; their states before are restored after. A trial run in this process reseeds both
    (``federation.seed``), so without this every proposal after the first would repeat the same draws; with it,
    a sweep proposes the same trials every time it runs."""
    python, numpy = random.getstate(), np.random.get_state()
    search = {k: sweep.search.get(k) for k in ("method", "metric", "parameters")}
    key = f"{json.dumps(search, sort_keys=True, default=str)}/{number}".encode()
    seed = int.from_bytes(hashlib.sha256(key).digest()[:4], "big")
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


def _check_parameter_values(sweep: Sweep, fixed: list[str]) -> None:
    """Validate each listed value (and each value-space min/max) of every parameter with the base config,
    so that a typo in a key or a value out of range stops the sweep before any trial runs."""
    for name, spec in sweep.search["parameters"].items():
        values = list(spec.get("values", [spec["value"]] if "value" in spec else []))
        # Without a distribution, min/max mean int_uniform or uniform (by their type): bounds in value space.
        if spec.get("distribution", "int_uniform" if "min" in spec else None) in VALUE_BOUNDED:
            values += [spec["min"], spec["max"]]
        for value in values:
            try:
                load_config(sweep.config_path, fixed + [_arg(name, value)])
            except ConfigError as e:
                raise ConfigError(
                    f"{sweep.path}: parameter {name} = {value!r} does not give a valid config: {e}"
                ) from None


def _arg(name: str, value: Any) -> str:
    # Exactly how wandb agent writes ${args_no_hyphens}, so that both paths load the same config.
    return f"{name}={value}"


def _plain(value: Any) -> Any:
    """Engine values as JSON/YAML-safe Python values (it samples NumPy scalars)."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _normalized(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _load_trials(sweep_dir: Path, identity: dict[str, Any]) -> list[dict[str, Any]]:
    state_file = sweep_dir / "trials.json"
    if not state_file.is_file():
        return []
    try:
        state = json.loads(state_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{state_file} is not valid JSON ({e}); delete it to start the sweep over.") from None
    if state.get("sweep") != identity:
        changed = [k for k in identity if state.get("sweep", {}).get(k) != identity[k]]
        raise ConfigError(
            f"{sweep_dir} holds trials of a different sweep (changed: {', '.join(changed)}). "
            "Delete that directory to start over, or pass output_dir=... to keep both."
        )
    return state["trials"]


def _save(sweep_dir: Path, identity: dict[str, Any], result: SweepResult) -> None:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(sweep_dir / "trials.json", json.dumps({"sweep": identity, "trials": result.trials}, indent=2))
    write_atomically(sweep_dir / "results.csv", csv_text(result.rows()))
    write_atomically(sweep_dir / "results.md", markdown_table(result.rows()))


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows as a Markdown table (floats to 4 significant digits); empty text for no rows."""
    if not rows:
        return ""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)).replace("|", "\\|") for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def print_results(result: SweepResult) -> None:
    """The results table (Markdown, as in results.md), the best trial and the sweep directory, on stdout."""
    print(markdown_table(result.rows()), end="")
    best = result.best()
    if best is not None:
        args = " ".join(_arg(k, v) for k, v in best["parameters"].items())
        print(f"Best {result.sweep.metric}: {best['metrics'][result.sweep.metric]:.4g} (trial {best['trial']}: {args})")
    print(f"Sweep directory: {result.sweep_dir}")
