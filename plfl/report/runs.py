"""Reading a finished run directory into what the report plots.

A run directory (``runs/<name>/<time>/``, see plfl/callbacks/files.py) holds
config.yaml, summary.json, metrics.csv (one row per round), clients.csv (one
row per client per evaluated round) and optionally tables/<name>.csv (one row
per table entry, with a ``round`` column). Accuracies stay fractions in [0, 1].
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from plfl.compare import dataset_name, short_keys, value_texts
from plfl.config import dotted_items
from plfl.errors import PlflError
from plfl.metrics import tail_means

REQUIRED = ("config.yaml", "summary.json", "metrics.csv", "clients.csv")

Row = dict[str, Any]


@dataclass
class ReportRun:
    """One finished run, as read from its directory."""

    run_dir: Path
    name: str  # the config's name (runs/<name>/...)
    method: str
    dataset: str  # data.source, with the PFLlib directory's name for pfllib data
    seed: int
    summary: dict[str, Any]  # summary.json as is (status, best_accuracy, best_round, ...)
    metrics: list[Row]  # metrics.csv: one row per round; empty cells are None
    clients: list[Row]  # clients.csv: one row per (evaluated round, client)
    tables: dict[str, list[Row]] = field(default_factory=dict)  # tables/<name>.csv by name
    config: dict[str, Any] = field(default_factory=dict)  # config.yaml by dotted key, e.g. "method.s"
    label: str = ""  # legend entry, short and unique among the report's runs (see label_runs)
    inversion: Optional[dict[str, Any]] = None  # inversion.json, where plfl invert attacked the run

    @property
    def status(self) -> str:
        return self.summary.get("status", "unknown")

    @property
    def details(self) -> str:
        """Method, data set, seed and directory, for hover texts (plotly's HTML subset, one line break)."""
        return f"{self.method}, {self.dataset}, seed {self.seed}<br>{self.run_dir}"

    def series(self, column: str) -> tuple[list[int], list[float]]:
        """(rounds, values) of a metrics.csv column, leaving out rounds where it is empty."""
        rows = [r for r in self.metrics if r.get(column) is not None]
        return [int(r["round"]) for r in rows], [float(r[column]) for r in rows]

    def has(self, column: str) -> bool:
        """Whether metrics.csv has a value in ``column`` in any round."""
        return any(r.get(column) is not None for r in self.metrics)

    def client_accuracies(self, round_: int) -> list[float]:
        """Accuracy (fraction) of every client with test samples, evaluated in ``round_``; [] if not evaluated."""
        return [float(r["accuracy"]) for r in self.clients if r["round"] == round_ and r["num_test"]]

    def tail_series(self) -> tuple[list[int], list[float], list[float]]:
        """(evaluated rounds, worst-10 % mean, top-10 % mean) from clients.csv, by plfl.metrics.tail_means."""
        rounds = sorted({int(r["round"]) for r in self.clients})
        rounds = [r for r in rounds if self.client_accuracies(r)]
        tails = [tail_means(self.client_accuracies(r)) for r in rounds]
        return rounds, [t[0] for t in tails], [t[1] for t in tails]

    def last_table_round(self, table: str) -> Optional[int]:
        """The last round that ``tables/<table>.csv`` has rows of; None without the table."""
        rows = self.tables.get(table)
        return int(max(r["round"] for r in rows)) if rows else None


def read_report_run(run_dir: Path) -> ReportRun:
    """Reads ``run_dir``'s config.yaml, summary.json, metrics.csv, clients.csv and tables/*.csv, and
    inversion.json where there is one (``plfl invert``).

    Failed runs are read too (their summary says ``status: failed``); their
    rounds up to the failure are in the CSV files.

    Raises:
        PlflError: a required file is missing (the message names the directory,
            the files and how to get them) or a file cannot be parsed.
    """
    missing = [name for name in REQUIRED if not (run_dir / name).is_file()]
    if missing:
        raise PlflError(f"{run_dir} lacks {', '.join(missing)}: {_missing_fix(run_dir, missing)}")
    try:
        cfg = OmegaConf.load(run_dir / "config.yaml")
        summary = json.loads((run_dir / "summary.json").read_text())
        tables = {p.stem: read_csv(p) for p in sorted((run_dir / "tables").glob("*.csv"))}
        return ReportRun(
            run_dir,
            str(cfg.get("name", run_dir.parent.name)),
            cfg.method.name,
            dataset_name(cfg),
            int(cfg.federation.seed),
            summary,
            read_csv(run_dir / "metrics.csv"),
            read_csv(run_dir / "clients.csv"),
            tables,
            dict(dotted_items(cfg)),
            inversion=json.loads(inversion.read_text())
            if (inversion := run_dir / "inversion.json").is_file()
            else None,
        )
    except (ValueError, KeyError, AttributeError, OSError) as e:  # json, CSV and OmegaConf errors
        raise PlflError(
            f"Cannot read the run in {run_dir} ({type(e).__name__}: {e}); its files are damaged "
            "or from another program: leave it out of the report or run it again."
        ) from None


def _missing_fix(run_dir: Path, missing: list[str]) -> str:
    if "config.yaml" in missing or "summary.json" in missing:
        return "it is not a finished plfl run directory; pass runs/<name>/<time>/ or a folder holding such directories."
    if OmegaConf.select(OmegaConf.load(run_dir / "config.yaml"), "logger.name") == "none":
        return "the run was made with logger.name=none, which writes no metrics; run it again with logger.name=csv."
    if json.loads((run_dir / "summary.json").read_text()).get("status") != "completed":
        return "the run failed before its first evaluated round; leave it out of the report or run it again."
    return "its files were moved or deleted; pass the whole directory that plfl fit wrote."


def read_csv(path: Path) -> list[Row]:
    """Rows of a plfl CSV file; cells become float (int for whole numbers), bool, None (empty) or str."""
    with open(path, newline="") as f:
        return [{key: _cell(value) for key, value in row.items()} for row in csv.DictReader(f)]


def _cell(text: Optional[str]) -> Any:
    if text is None or text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number


def label_runs(runs: list[ReportRun], most_keys: int = 3) -> None:
    """Sets each run's legend label: its name; where runs share a name (a sweep, ``--seeds``), the name and
    the config values that tell them apart, each key by its last part where that is unambiguous
    (``fedala-s: s=80, seed=1`` for method.s and federation.seed), or the time folder if more than
    ``most_keys`` keys differ; `` [failed]`` if it did not complete. Method, data set, seed and directory
    are in the hover text (``details``)."""
    by_name: dict[str, list[ReportRun]] = {}
    for run in runs:
        by_name.setdefault(run.name, []).append(run)
    for group in by_name.values():
        first, shared = group[0].config, set.intersection(*(set(r.config) for r in group))
        differing = [k for k in first if k in shared and any(r.config[k] != first[k] for r in group)]
        short = short_keys(differing)
        texts = {k: value_texts([r.config[k] for r in group]) for k in differing}
        for i, run in enumerate(group):
            if len(group) == 1:
                run.label = run.name
            elif differing and len(differing) <= most_keys:
                run.label = f"{run.name}: " + ", ".join(f"{short[k]}={texts[k][i]}" for k in differing)
            else:
                run.label = f"{run.name}: {run.run_dir.name}"
            if run.status != "completed":
                run.label += f" [{run.status}]"
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.label] = counts.get(run.label, 0) + 1
    for run in runs:
        if counts[run.label] > 1:  # same name and config: from different output folders, or run twice
            run.label += f" ({run.run_dir})"
