"""Plain result files in the run directory: metrics.csv, clients.csv, ``tables/*.csv``, summary.json."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from plfl.callbacks.base import FederationCallback, RoundResult, RunInfo


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new file, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def csv_text(rows: list[dict[str, Any]]) -> str:
    """Rows as CSV; the columns are the union of the rows' keys in first-seen order."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


class RunFiles(FederationCallback):
    """Writes summary.json at the end (also when the run fails) and, with
    ``metrics=True``, metrics.csv (one row per round), clients.csv (one row
    per client per evaluated round) and the method's tables as
    ``tables/<name>.csv`` (with a ``round`` column), rewritten after every round."""

    def __init__(self, metrics: bool = True):
        self.metrics = metrics
        self.rounds: list[dict[str, Any]] = []
        self.clients: list[dict[str, Any]] = []
        self.tables: dict[str, list[dict[str, Any]]] = {}

    def on_fit_start(self, run: RunInfo) -> None:
        """On resume, the files are rewritten from the restored rounds: rows of rounds
        that ran after the checkpoint, before the crash, are dropped."""
        self.run_dir = run.run_dir
        for result in run.history:
            self._add(result)
        if run.history and self.metrics:
            self._write(set(self.tables))

    def on_round_end(self, run: RunInfo, result: RoundResult) -> None:
        self._add(result)
        if self.metrics:
            self._write(set(result.tables))

    def _add(self, result: RoundResult) -> None:
        self.rounds.append(result.metrics)
        self.clients.extend(result.clients)
        for name, rows in result.tables.items():
            self.tables.setdefault(name, []).extend({"round": result.round, **row} for row in rows)

    def _write(self, tables: set[str]) -> None:
        write_atomically(self.run_dir / "metrics.csv", csv_text(self.rounds))
        if self.clients:
            write_atomically(self.run_dir / "clients.csv", csv_text(self.clients))
        for name in tables:
            (self.run_dir / "tables").mkdir(exist_ok=True)
            write_atomically(self.run_dir / "tables" / f"{name}.csv", csv_text(self.tables[name]))

    def on_fit_end(self, run: RunInfo, summary: dict[str, Any]) -> None:
        write_atomically(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")

    on_fit_error = on_fit_end
