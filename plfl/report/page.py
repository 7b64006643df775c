"""The report page: one self-contained HTML file, plotly.js inline (opens offline)."""

from __future__ import annotations

import html

import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

from plfl.report.runs import ReportRun

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1300px; padding: 0 1em; color: #222; }
table { border-collapse: collapse; font-size: 0.9em; margin-bottom: 1.5em; }
th, td { border-bottom: 1px solid #ddd; padding: 0.3em 0.7em; text-align: left; }
td.num { text-align: right; }
.figure { margin-bottom: 2em; }
"""


def _percent(value) -> str:
    return "–" if value is None else f"{100 * value:.2f}"


def _number(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def runs_table(runs: list[ReportRun]) -> str:
    """An HTML table of the runs: label, status, best / final accuracy (%), costs per round, directory."""
    head = ("<tr><th>run</th><th>status</th><th>best accuracy (%)</th><th>best round</th>"
            "<th>final accuracy (%)</th><th>s / round</th><th>bytes sent / round</th><th>directory</th></tr>")
    rows = []
    for run in runs:
        s = run.summary
        cells = [html.escape(run.label), html.escape(run.status)]
        numbers = [_percent(s.get("best_accuracy")), str(s.get("best_round", "–")),
                   _percent(s.get("final_accuracy")), _number(s.get("seconds_per_round")),
                   _number(s.get("bytes_sent_per_round"), 0)]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells)
                    + "".join(f'<td class="num">{n}</td>' for n in numbers)
                    + f"<td><code>{html.escape(str(run.run_dir))}</code></td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def figure_div(fig: go.Figure, index: int) -> str:
    """The figure as a <div> and its drawing script, without plotly.js (the page holds it once)."""
    return pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=f"figure-{index}",
                       config={"displaylogo": False, "responsive": True})


def page_html(runs: list[ReportRun], figures: list[go.Figure], title: str = "plfl report") -> str:
    """The whole page: the runs table, then every figure; needs no network to open."""
    divs = "\n".join(f'<div class="figure">{figure_div(fig, i)}</div>' for i, fig in enumerate(figures))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<link rel="icon" href="data:,">
<style>{STYLE}</style>
<script type="text/javascript">{get_plotlyjs()}</script>
</head>
<body>
<h1>{html.escape(title)}</h1>
<p>{len(runs)} run{"s" if len(runs) != 1 else ""}. Accuracies in %: personalized models, each on its
client's own test split. Hover for values, drag to zoom, click legend entries to hide runs.</p>
{runs_table(runs)}
{divs}
</body>
</html>
"""
