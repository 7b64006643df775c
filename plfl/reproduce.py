"""A paper's table as one command: ``plfl reproduce SUITE [--cells PATTERN] [--rounds N] [--seeds K]
[--parallel N] [key=value ...]`` and ``plfl reproduce --list``.

A suite (``suites/<name>.yaml``) describes one table of a paper: its data settings (the table's columns: a config
and overrides each), its methods (the rows: overrides each, optionally another metric), the rounds and seeds the
paper ran, the metric and round rule it reports (``best``: the highest value over the evaluated rounds;
``final``: the last evaluated round's), the paper's value ± spread per cell, and claims of the form ``A > B``
(one method above another in every setting). A cell is one setting × one method; each of its seeds is an
ordinary run directory ``<output_dir>/reproduce/<suite>/<setting>/<method>/rounds-<R>/seed-<s>/`` (methods
with the same overrides share theirs), run as
``plfl fit --config <setting's config> <setting's overrides> <method's overrides> federation.rounds=R
federation.seed=s <command-line overrides>`` would. An invocation runs the seeds that have no finished run (a
stopped run continues from its newest checkpoint, as ``plfl fit --resume`` does), then writes ``results.csv``,
``results.md`` and ``results.json`` to ``<output_dir>/reproduce/<suite>/``: plfl's mean ± population standard
deviation over the seeds beside the paper's value and the gap, in percentage points, marked "scaled" where fewer
rounds than the paper's were run. With ``--parallel N`` up to N runs go at once, each a Ray task, as
``plfl sweep --parallel``.
"""

from __future__ import annotations

import csv
import fnmatch
import json
import re
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

from plfl.callbacks.files import csv_text, write_atomically
from plfl.cluster import import_ray
from plfl.compare import SAME_EXPERIMENT
from plfl.config import dotted_items, load_config, read_yaml
from plfl.errors import ConfigError
from plfl.sweep import InProcessTrials, RayTrials, markdown_table

SUITES = Path(__file__).resolve().parents[1] / "suites"  # the suites of the repository, in a clone
ROUND_RULES = ("best", "final")
SUITE_KEYS = {"title", "paper", "rounds", "seeds", "metric", "round", "settings", "methods", "reported", "claims"}
SUITE_KEYS_OPTIONAL = {"choices", "cells"}
# Config keys that do not make a finished run another experiment than a cell's: where its files go and how it
# executes (compare's list without the seed, which is the cell's), the data's location, the torch thread count.
PLACE_KEYS = tuple(k for k in SAME_EXPERIMENT if k != "federation.seed") + (
    "data.root",
    "data.cache_dir",
    "federation.threads",
)
PLACE_SECTIONS = ("logger.", "ray.", "vectorized.", "trainer.")
VALUE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(?:(?:±|\+-|\+/-)\s*(\d+(?:\.\d+)?))?\s*$")
CLAIM = re.compile(r"^\s*([\w.-]+)\s*>\s*([\w.-]+)\s*$")


@dataclass
class Setting:
    """A data setting of the table (a column): a config file and overrides of it."""

    name: str
    config: str
    overrides: list[str]


@dataclass
class Method:
    """A method of the table (a row): overrides (``method=fedavg``, ``method.s=80``) and, where the paper reports
    another quantity for it, the metrics.csv column to read (``global_accuracy``)."""

    name: str
    overrides: list[str]
    metric: Optional[str] = None


@dataclass
class Suite:
    """A parsed suite file (see the module docstring); ``reported[(setting, method)]`` is the paper's
    ``(value, spread)`` in % (spread None where the paper gives none); cells without a published value are
    absent from it."""

    path: Path
    title: str
    paper: str
    rounds: int
    seeds: int
    metric: str
    round_rule: str
    settings: dict[str, Setting]
    methods: dict[str, Method]
    cells: list[tuple[str, str]]  # (setting, method), in table order: method by method
    reported: dict[tuple[str, str], tuple[float, Optional[float]]]
    claims: list[tuple[str, str]]  # (higher, lower): methods
    choices: str = ""

    @property
    def name(self) -> str:
        return self.path.stem

    def metric_of(self, method: str) -> str:
        return self.methods[method].metric or self.metric

    def runs_of(self, method: str) -> str:
        """The method whose runs ``method``'s cells read: the first with the same overrides (a table that reports
        several quantities of one run, e.g. Self-FL's Table 1 columns, trains it once)."""
        overrides = self.methods[method].overrides
        return next(name for name, m in self.methods.items() if m.overrides == overrides)


@dataclass
class CellResult:
    """One cell of a suite after an invocation: its values (fractions, one per finished seed), the seeds asked
    for, the runs that failed and the rounds run."""

    setting: str
    method: str
    metric: str
    values: list[float] = field(default_factory=list)
    seeds: int = 0
    failed: list[str] = field(default_factory=list)  # "run_dir: error"
    rounds: int = 0


def load_suite(path: str | Path) -> Suite:
    """Read and check a suite file.

    Raises:
        ConfigError: the file is missing or not YAML; a key is missing or unknown; ``rounds`` or ``seeds`` is not
            a positive integer; ``round`` is not best or final; a setting lacks ``config``; a method or a reported
            value names a setting or method the suite lacks; a reported value is not ``mean`` or ``mean ± std``;
            a claim is not ``A > B``. Each message names the key and the fix.
    """
    path = Path(path)
    data = read_yaml(path, f"Suite file {path} does not exist. {suite_list_hint()}")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping with the keys {', '.join(sorted(SUITE_KEYS))}.")
    missing, unknown = SUITE_KEYS - set(data), set(data) - SUITE_KEYS - SUITE_KEYS_OPTIONAL
    if missing or unknown:
        problems = [f"missing {', '.join(sorted(missing))}"] if missing else []
        problems += [f"unknown {', '.join(sorted(unknown))}"] if unknown else []
        raise ConfigError(
            f"{path}: {'; '.join(problems)}. A suite has {', '.join(sorted(SUITE_KEYS))} (and optionally "
            f"{', '.join(sorted(SUITE_KEYS_OPTIONAL))}); see suites/ for examples."
        )
    for key in ("rounds", "seeds"):
        if not isinstance(data[key], int) or isinstance(data[key], bool) or data[key] < 1:
            raise ConfigError(f"{path}: {key} must be an integer >= 1; got {data[key]!r}.")
    if data["round"] not in ROUND_RULES:
        raise ConfigError(f"{path}: round must be one of {', '.join(ROUND_RULES)}; got {data['round']!r}.")
    settings = {name: _setting(path, name, spec) for name, spec in _mapping(path, data, "settings").items()}
    methods = {name: _method(path, name, spec) for name, spec in _mapping(path, data, "methods").items()}
    cells = [(s, m) for m in methods for s in settings]
    if "cells" in data:  # a table whose rows do not all run on every column
        cells = [_cell(path, text, settings, methods) for text in data["cells"] or []]
    reported = {}
    for method, row in _mapping(path, data, "reported").items():
        if method not in methods:
            raise ConfigError(f"{path}: reported names method {method!r}; the suite's methods are {_names(methods)}.")
        for setting, text in (row or {}).items():
            if setting not in settings:
                raise ConfigError(
                    f"{path}: reported.{method} names setting {setting!r}; the suite's settings are {_names(settings)}."
                )
            if text is not None:
                reported[(setting, method)] = _value(path, f"reported.{method}.{setting}", text)
    claims = []
    for text in data["claims"] or []:
        match = CLAIM.match(str(text))
        if not match or not {match[1], match[2]} <= set(methods):
            raise ConfigError(
                f"{path}: claim {text!r} must be 'A > B' with A and B among the methods {_names(methods)}."
            )
        claims.append((match[1], match[2]))
    return Suite(
        path,
        str(data["title"]),
        str(data["paper"]),
        data["rounds"],
        data["seeds"],
        str(data["metric"]),
        data["round"],
        settings,
        methods,
        cells,
        reported,
        claims,
        str(data.get("choices") or "").strip(),
    )


def _mapping(path: Path, data: dict, key: str) -> dict:
    value = data[key] or {}
    if not isinstance(value, dict) or (key != "reported" and not value):
        raise ConfigError(f"{path}: {key} must be a non-empty mapping of names to their entries.")
    return value


def _names(entries: dict) -> str:
    return ", ".join(entries)


def _overrides(path: Path, where: str, value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and "=" in v for v in value):
        raise ConfigError(f"{path}: {where} must be a list of key=value overrides, e.g. [method=fedavg].")
    return list(value)


def _setting(path: Path, name: str, spec: Any) -> Setting:
    if not isinstance(spec, dict) or "config" not in spec or set(spec) - {"config", "overrides"}:
        raise ConfigError(f"{path}: settings.{name} must be a mapping with config (a YAML file) and overrides.")
    return Setting(name, str(spec["config"]), _overrides(path, f"settings.{name}.overrides", spec.get("overrides")))


def _method(path: Path, name: str, spec: Any) -> Method:
    if isinstance(spec, list):
        spec = {"overrides": spec}
    if not isinstance(spec, dict) or set(spec) - {"overrides", "metric"}:
        raise ConfigError(
            f"{path}: methods.{name} must be a list of overrides, or a mapping with overrides and metric."
        )
    return Method(name, _overrides(path, f"methods.{name}.overrides", spec.get("overrides")), spec.get("metric"))


def _cell(path: Path, text: Any, settings: dict, methods: dict) -> tuple[str, str]:
    setting, _, method = str(text).partition("/")
    if setting not in settings or method not in methods:
        raise ConfigError(
            f"{path}: cell {text!r} must be SETTING/METHOD with a setting among {_names(settings)} and a method "
            f"among {_names(methods)}."
        )
    return setting, method


def _value(path: Path, where: str, text: Any) -> tuple[float, Optional[float]]:
    match = VALUE.match(str(text))
    if not match:
        raise ConfigError(f"{path}: {where} = {text!r} must be a number (%) or 'mean ± std', e.g. 99.88 ± 0.01.")
    return float(match[1]), None if match[2] is None else float(match[2])


def suite_path(name: str) -> Path:
    """The suite file ``name``: a path, or the stem of a file in the repository's ``suites/``."""
    given = Path(name)
    if given.suffix in (".yaml", ".yml") or given.exists():
        return given
    return SUITES / f"{name}.yaml"


def list_suites() -> list[Suite]:
    """The repository's suites, by name.

    Raises:
        ConfigError: a suite file there is malformed.
    """
    return [load_suite(p) for p in sorted(SUITES.glob("*.yaml"))]


def suite_list_hint() -> str:
    names = sorted(p.stem for p in SUITES.glob("*.yaml"))
    if not names:
        return "Pass a suite file; the repository's are in its suites/ folder."
    return f"Pass a suite file or one of the repository's suites ({', '.join(names)}); plfl reproduce --list."


def run_suite(
    suite: Suite,
    overrides: list[str] = (),
    cells: Optional[str] = None,
    rounds: Optional[int] = None,
    seeds: Optional[int] = None,
    parallel: int = 1,
    echo: Callable[[str], None] = print,
    run: bool = True,
) -> tuple[Path, list[CellResult]]:
    """Run the suite's runs that are not finished, then write its tables; returns the suite directory and the
    cells' results.

    Args:
        suite: the suite (:func:`load_suite`).
        overrides: ``key=value`` applied to every run, after the setting's and the method's.
        cells: an fnmatch pattern over ``SETTING/METHOD`` (``cifar10-*/fed*``); default all cells.
        rounds: rounds per run (default the suite's; fewer mark the table "scaled").
        seeds: the first ``seeds`` seeds (0, 1, ...) per cell (default the suite's).
        parallel: runs at once; above 1 each is a Ray task (:class:`plfl.sweep.RayTrials`).
        echo: where a line per run goes.
        run: False: run nothing, write and return the tables of the runs there are (an unfinished one is listed
            with its last round), e.g. while the suite runs elsewhere.

    A run that finished (completed, or failed: its error is shown) is read as it is; one with a checkpoint
    continues from it; one that left neither is moved aside (``seed-<s>.stopped-<time>``) and run again.

    Raises:
        ConfigError: no cell matches ``cells``; ``rounds``, ``seeds`` or ``parallel`` below 1; a cell's config
            or override is invalid (before any run starts); a run directory holds a run of another config (the
            message lists the keys that differ); Ray is missing with ``parallel`` above 1.
    """
    rounds, seed_count = rounds or suite.rounds, seeds or suite.seeds
    for name, value in (("--rounds", rounds), ("--seeds", seed_count), ("--parallel", parallel)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1; got {value}.")
    selected = [c for c in suite.cells if cells is None or fnmatch.fnmatchcase(f"{c[0]}/{c[1]}", cells)]
    if not selected:
        available = ", ".join(f"{s}/{m}" for s, m in suite.cells)
        raise ConfigError(f"No cell of {suite.path} matches --cells {cells!r}; its cells are {available}.")
    ray = import_ray("plfl reproduce --parallel") if parallel > 1 else None
    jobs, results, cell_runs, suite_dir = {}, {}, [], None
    for setting, method in selected:
        results[(setting, method)] = CellResult(setting, method, suite.metric_of(method), seeds=seed_count)
        for seed in range(seed_count):
            config, args = cell_config(suite, setting, method, rounds, seed, overrides)
            cfg = load_config(config, args)  # every cell's config is checked before any run starts
            if ray is not None and cfg.federation.executor == "ray":
                raise ConfigError(
                    "plfl reproduce --parallel runs each seed as one Ray task, which cannot start Ray actors of its "
                    "own: drop --parallel or use another federation.executor."
                )
            suite_dir = Path(cfg.output_dir) / "reproduce" / suite.name
            run_dir = run_path(suite, suite_dir, setting, method, rounds, seed)
            jobs.setdefault(run_dir, ((setting, suite.runs_of(method), seed), config, args, _experiment(cfg)))
            cell_runs.append(((setting, method), run_dir))
    pending = [(d, *job) for d, job in jobs.items() if run and _prepare(d, job[3]) != "finished"]
    runner = RayTrials(ray, parallel, None, suite.path) if ray is not None else InProcessTrials(None, suite.path)
    errors = {}  # run directory → why its run failed, for a run that left no summary.json (e.g. unreadable data)
    try:
        while pending or runner.running:
            while pending and len(runner.running) < parallel:
                run_dir, key, config, args, _ = pending.pop(0)
                resume = _has_checkpoint(run_dir)
                run_dir.mkdir(parents=True, exist_ok=True)
                echo(f"{key[0]}/{key[1]} seed {key[2]}: {run_dir}" + (" (continues)" if resume else ""))
                runner.submit(run_dir, config, args, str(run_dir), resume)
            run_dir, outcome = runner.next_finished()
            key = jobs[run_dir][0]
            if outcome["error"] is not None:
                errors[run_dir] = outcome["error"]
            status = outcome["status"] + ("" if outcome["error"] is None else f": {outcome['error']}")
            echo(f"{key[0]}/{key[1]} seed {key[2]}: {status}")
    finally:
        runner.close()
    for cell, run_dir in cell_runs:
        if run or (run_dir / "config.yaml").is_file():
            _read_cell(results[cell], run_dir, rounds, suite.round_rule, errors.get(run_dir))
    table = [results.get(cell) or _read_others(suite, suite_dir, cell, rounds, seed_count) for cell in suite.cells]
    table = [r for r in table if r.values or r.failed or (r.setting, r.method) in results]
    write_tables(suite, suite_dir, table)
    return suite_dir, table


def run_path(suite: Suite, suite_dir: Path, setting: str, method: str, rounds: int, seed: int) -> Path:
    """The run directory of one seed of a cell; methods with the same overrides share it
    (:meth:`Suite.runs_of`)."""
    return suite_dir / setting / suite.runs_of(method) / f"rounds-{rounds}" / f"seed-{seed}"


def _read_others(suite: Suite, suite_dir: Path, cell: tuple[str, str], rounds: int, seeds: int) -> CellResult:
    """A cell this invocation did not select, from the runs it has at ``rounds`` (none: no values), so that the
    tables show every cell run so far."""
    setting, method = cell
    result = CellResult(setting, method, suite.metric_of(method), seeds=seeds)
    for seed in range(seeds):
        run_dir = run_path(suite, suite_dir, setting, method, rounds, seed)
        if (run_dir / "summary.json").is_file():
            _read_cell(result, run_dir, rounds, suite.round_rule)
    return result


def cell_config(
    suite: Suite, setting: str, method: str, rounds: int, seed: int, overrides: list[str] = ()
) -> tuple[str, list[str]]:
    """The config file and overrides of one run of a cell."""
    s, m = suite.settings[setting], suite.methods[method]
    return s.config, [*s.overrides, *m.overrides, f"federation.rounds={rounds}", f"federation.seed={seed}", *overrides]


def _experiment(cfg: Any) -> dict[str, Any]:
    """The keys of a resolved config that make it this experiment (:data:`PLACE_KEYS` left out)."""
    return {k: v for k, v in dotted_items(cfg) if k not in PLACE_KEYS and not k.startswith(PLACE_SECTIONS)}


def _has_checkpoint(run_dir: Path) -> bool:
    from plfl.checkpoint import list_checkpoints

    return bool(list_checkpoints(run_dir / "checkpoints"))


def _prepare(run_dir: Path, experiment: dict[str, Any]) -> str:
    """``finished`` (completed or failed), ``continues`` (a checkpoint to continue from) or ``new`` for the run
    in ``run_dir``; a run there of another experiment is refused, and one that left nothing to continue is moved
    aside so that the run starts over in an empty directory.

    Raises:
        ConfigError: ``run_dir`` holds a run whose config differs from ``experiment``: the keys that differ.
    """
    if not (run_dir / "config.yaml").is_file():
        return "new" if not run_dir.exists() or not any(run_dir.iterdir()) else _move_aside(run_dir)
    found = _experiment(load_config(run_dir / "config.yaml"))  # with the defaults of keys newer than the run
    changed = sorted(k for k in found.keys() | experiment.keys() if found.get(k) != experiment.get(k))
    if changed:
        shown = ", ".join(f"{k} ({found.get(k)!r} there, {experiment.get(k)!r} now)" for k in changed[:5])
        raise ConfigError(
            f"{run_dir} holds a run of another config: {shown}. The suite or the overrides changed since it ran; "
            "move that directory away to run the cell again, or pass output_dir=... to keep both."
        )
    summary = run_dir / "summary.json"
    if summary.is_file() and json.loads(summary.read_text()).get("status") in ("completed", "failed"):
        return "finished"
    return "continues" if _has_checkpoint(run_dir) else _move_aside(run_dir)


def _move_aside(run_dir: Path) -> str:
    run_dir.rename(run_dir.with_name(f"{run_dir.name}.stopped-{datetime.now():%Y%m%d-%H%M%S}"))
    return "new"


def _read_cell(result: CellResult, run_dir: Path, rounds: int, rule: str, error: Optional[str] = None) -> None:
    """Add the run in ``run_dir`` to its cell: its metric over the evaluated rounds by ``rule`` (``best``: the
    highest; ``final``: the last), or its failure (``error``: why, where the run wrote no summary.json).

    Raises:
        ConfigError: the run's metrics.csv has no value of the cell's metric (the message lists its columns).
    """
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    if summary.get("status") != "completed":
        why = summary.get("error") or error or summary.get("status") or _progress(run_dir, rounds)
        result.failed.append(f"{run_dir}: {why}")
        return
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get(result.metric) not in (None, "")]
    if not rows:
        with open(run_dir / "metrics.csv", newline="") as f:
            columns = next(csv.reader(f), [])
        raise ConfigError(
            f"metrics.csv of {run_dir} has no value of {result.metric!r}; the suite's metric must be one of its "
            f"columns: {', '.join(columns)}."
        )
    values = [float(r[result.metric]) for r in rows]
    result.values.append(max(values) if rule == "best" else values[-1])
    result.rounds = rounds


def _progress(run_dir: Path, rounds: int) -> str:
    """What a run without summary.json has done: ``unfinished (round r of R)``, or ``not run``."""
    metrics = run_dir / "metrics.csv"
    if not metrics.is_file():
        return "not run"
    with open(metrics, newline="") as f:
        last = max((int(r["round"]) for r in csv.DictReader(f)), default=0)
    return f"unfinished (round {last} of {rounds})"


def write_tables(suite: Suite, suite_dir: Path, results: list[CellResult]) -> None:
    """``results.csv`` (:func:`table_rows`), ``results.md`` (:func:`suite_text`) and ``results.json`` (title,
    paper, rows and each claim's lines: what ``plfl report`` shows of the suite) in ``suite_dir``."""
    suite_dir.mkdir(parents=True, exist_ok=True)
    rows = table_rows(suite, results)
    claims = {f"{a} > {b}": claim_lines(results, a, b) for a, b in suite.claims}
    write_atomically(suite_dir / "results.csv", csv_text(rows))
    write_atomically(suite_dir / "results.md", suite_text(suite, results))
    write_atomically(
        suite_dir / "results.json",
        json.dumps({"title": suite.title, "paper": suite.paper, "rows": rows, "claims": claims}, indent=2),
    )


def table_rows(suite: Suite, results: list[CellResult]) -> list[dict[str, Any]]:
    """One row per cell: setting, method, metric, plfl's mean and std (%), seeds finished, the paper's value and
    spread (%), the gap (plfl − paper, points), the rounds run, whether scaled, and the failed runs."""
    rows = []
    for r in results:
        mean = 100 * statistics.fmean(r.values) if r.values else None
        std = 100 * statistics.pstdev(r.values) if len(r.values) > 1 else None
        paper, spread = suite.reported.get((r.setting, r.method), (None, None))
        rows.append(
            {
                "setting": r.setting,
                "method": r.method,
                "metric": f"{r.metric} ({suite.round_rule})",
                "plfl": mean,
                "plfl_std": std,
                "seeds": f"{len(r.values)}/{r.seeds}",
                "paper": paper,
                "paper_std": spread,
                "gap": None if mean is None or paper is None else mean - paper,
                "rounds": r.rounds or None,
                "scaled": bool(r.rounds) and r.rounds < suite.rounds,
                "failed": "; ".join(r.failed),
            }
        )
    return rows


def suite_text(suite: Suite, results: list[CellResult]) -> str:
    """The suite's table in Markdown and its claims, as printed and as ``results.md`` holds them."""
    lines = [f"# {suite.title}", "", suite.paper, ""]
    shown = []
    for row in table_rows(suite, results):
        shown.append(
            {
                "setting": row["setting"],
                "method": row["method"],
                "metric": row["metric"],
                "plfl (%)": mean_std_text(row["plfl"], row["plfl_std"]),
                "paper (%)": mean_std_text(row["paper"], row["paper_std"]),
                "gap": "" if row["gap"] is None else f"{row['gap']:+.2f}",
                "seeds": row["seeds"],
                "rounds": "" if not row["rounds"] else f"{row['rounds']}" + (" (scaled)" if row["scaled"] else ""),
            }
        )
    lines.append(markdown_table(shown).rstrip())
    for higher, lower in suite.claims:
        lines += ["", f"Claim: {higher} > {lower}"] + [f"- {line}" for line in claim_lines(results, higher, lower)]
    failed = [f for r in results for f in r.failed]
    if failed:
        lines += [
            "",
            "Runs without a value (an unfinished run continues at the next call; a failed one is kept as it is: "
            "move its directory away to run it again):",
        ]
        lines += [f"- {f}" for f in failed]
    return "\n".join(lines) + "\n"


def claim_lines(results: list[CellResult], higher: str, lower: str) -> list[str]:
    """Per setting where both methods have values: whether ``higher``'s mean is above ``lower``'s."""
    by_cell = {(r.setting, r.method): r for r in results}
    lines = []
    for setting in dict.fromkeys(r.setting for r in results):
        a, b = by_cell.get((setting, higher)), by_cell.get((setting, lower))
        if a is None or b is None or not a.values or not b.values:
            continue
        x, y = 100 * statistics.fmean(a.values), 100 * statistics.fmean(b.values)
        lines.append(f"{setting}: {'holds' if x > y else 'does not hold'} ({x:.2f} vs {y:.2f})")
    return lines or ["not measured yet"]


def mean_std_text(mean: Optional[float], std: Optional[float], missing: str = "") -> str:
    """``mean ± std`` (%), two decimals; ``mean`` alone without a std (one seed, a paper without a spread);
    ``missing`` without a mean."""
    if mean is None:
        return missing
    return f"{mean:.2f}" if std is None else f"{mean:.2f} ± {std:.2f}"
