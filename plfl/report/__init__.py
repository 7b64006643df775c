"""``plfl report``: one self-contained interactive HTML page of finished runs.

The page shows, for the runs given: accuracy per round, the client accuracy
distribution at each run's best round, worst-10 % / top-10 % client accuracy
and the largest 10 % of clients' accuracy, test and training loss, seconds
(measured and simulated) and bytes per round (log axes), and the panels a run
has data for (global-model accuracy, unseen against participating clients'
accuracy, ALA weights, Self-FL's σ_0², σ_m², l_m, pFedLA's aggregation-weight
heatmaps), and for a run ``plfl invert`` attacked its reconstruction (inversion.json's means, inversion.png).
It stays readable with many runs (a sweep's): short legend labels
with the details on hover, one colour per run, and a legend click shows or
hides a run in every figure. plotly.js is embedded, so the page opens offline.

Modules: ``runs`` reads run directories, ``figures`` builds one plotly figure
per panel, ``page`` assembles the HTML.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from plfl.compare import find_runs
from plfl.errors import PlflError, PlflWarning
from plfl.report.figures import all_figures
from plfl.report.page import page_html
from plfl.report.runs import ReportRun, label_runs, read_report_run

__all__ = ["ReportRun", "load_runs", "write_report"]


def load_runs(paths: list[Path]) -> list[ReportRun]:
    """The runs in ``paths`` (run directories, sweep directories, or folders searched for them), labelled for the
    legend. A run that did not complete and has no round to show (stopped in round 0) is left out with a warning.

    Raises:
        PlflError: a path does not exist, holds no run directory, or a completed run lacks a file (see
            read_report_run).
    """
    for path in paths:
        if not path.exists():
            raise PlflError(
                f"{path} does not exist; pass run directories (runs/<name>/<time>/) "
                "or folders holding them (e.g. runs/)."
            )
    runs = []
    for run_dir in find_runs(paths):
        try:
            runs.append(read_report_run(run_dir))
        except PlflError as error:
            summary = run_dir / "summary.json"
            status = json.loads(summary.read_text()).get("status") if summary.is_file() else None
            if status in (None, "completed"):
                raise
            warnings.warn(PlflWarning(f"Left out of the report: {run_dir} ({status}): {error}"), stacklevel=2)
    if not runs:
        raise PlflError(f"No run in {', '.join(map(str, paths))} has rounds to show.")
    label_runs(runs)
    return runs


def write_report(paths: list[Path], output: Path = Path("report.html")) -> Path:
    """Writes the report page of the runs in ``paths`` to ``output`` (its folder is created); returns ``output``.
    A suite directory of ``plfl reproduce`` among ``paths`` adds its table (``results.json``) above the runs.

    Raises:
        PlflError: as load_runs, or ``output`` cannot be written.
    """
    runs = load_runs(paths)
    suites = [json.loads((p / "results.json").read_text()) for p in paths if (p / "results.json").is_file()]
    text = page_html(runs, all_figures(runs), suites=suites)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text, encoding="utf-8")
    except OSError as e:
        raise PlflError(f"Cannot write the report to {output} ({e.strerror}); choose another path with -o.") from None
    return output
