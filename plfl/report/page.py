"""The report page: one self-contained HTML file, plotly.js inline (opens offline)."""

from __future__ import annotations

import base64
import html

import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

from plfl.report.figures import colour
from plfl.report.runs import ReportRun
from plfl.reproduce import mean_std_text

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1300px; padding: 0 1em; color: #222; }
table { border-collapse: collapse; font-size: 0.9em; margin-bottom: 1.5em; }
th, td { border-bottom: 1px solid #ddd; padding: 0.3em 0.7em; text-align: left; }
td.num { text-align: right; }
td.run { white-space: nowrap; }
td code { word-break: break-all; }  /* long run directories wrap: the table fits the page */
.table { overflow-x: auto; }
.figure { margin-bottom: 2em; }
"""


def _percent(value) -> str:
    return "–" if value is None else f"{100 * value:.2f}"


def _number(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def runs_table(runs: list[ReportRun]) -> str:
    """An HTML table of the runs: label (after a square of the run's colour), method, data set, seed, status,
    rounds, the accuracy (%) at the round selected on validation and that round (– without a validation split),
    best (on test, optimistic) and final accuracy (%), where any run has them the unseen clients' final accuracy
    and the participation gap (percentage points), costs per round (simulated seconds where any run has them),
    directory."""
    unseen = any("final_unseen_accuracy" in run.summary for run in runs)
    simulated = any("simulated_seconds_per_round" in run.summary for run in runs)
    head = (
        "<tr><th>run</th><th>method</th><th>data set</th><th>seed</th><th>status</th><th>rounds</th>"
        '<th title="test accuracy at the round of highest validation accuracy">selected accuracy (%)</th>'
        "<th>selected round</th>"
        '<th title="highest test accuracy over the rounds: optimistic, the test data choose the round">best '
        "accuracy (%)</th><th>best round</th><th>final accuracy (%)</th>"
        + (
            '<th title="federation.unseen_clients, at the final round">unseen accuracy (%)</th>'
            '<th title="participating minus unseen accuracy, final round">gap (pp)</th>'
            if unseen
            else ""
        )
        + "<th>s / round</th>"
        + ("<th>simulated s / round</th>" if simulated else "")
        + "<th>bytes sent / round</th><th>directory</th></tr>"
    )
    rows = []
    for run in runs:
        s = run.summary
        cells = [html.escape(str(c)) for c in (run.label, run.method, run.dataset, run.seed, run.status)]
        numbers = [
            str(s.get("rounds", "–")),
            _percent(s.get("selected_accuracy")),
            str(s.get("selected_round") if s.get("selected_round") is not None else "–"),
            _percent(s.get("best_accuracy")),
            str(s.get("best_round", "–")),
            _percent(s.get("final_accuracy")),
            *([_percent(s.get("final_unseen_accuracy")), _percent(s.get("final_participation_gap"))] if unseen else []),
            _number(s.get("seconds_per_round")),
            *([_number(s.get("simulated_seconds_per_round"))] if simulated else []),
            _number(s.get("bytes_sent_per_round"), 0),
        ]
        cells[0] = f'<span style="color: {colour(runs, run)}">&#9632;</span> {cells[0]}'  # its lines' colour
        rows.append(
            f'<tr><td class="run">{cells[0]}</td>'
            + "".join(f"<td>{c}</td>" for c in cells[1:])
            + "".join(f'<td class="num">{n}</td>' for n in numbers)
            + f"<td><code>{html.escape(str(run.run_dir))}</code></td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def inversion_section(runs: list[ReportRun]) -> str:
    """For the runs ``plfl invert`` attacked: the attack, client, round and batch, mean PSNR (dB), mean SSIM and
    label accuracy (inversion.json; ∞ dB where its PSNR is null: an exact reconstruction), and inversion.png inline
    (true images above their reconstructions)."""
    parts = []
    for run in runs:
        if run.inversion is None:
            continue
        i, png = run.inversion, run.run_dir / "inversion.png"
        image = base64.b64encode(png.read_bytes()).decode() if png.is_file() else None
        parts.append(
            f"<p>{html.escape(run.label)}: {i['attack'].upper()} on client {i['client']}'s upload of round "
            f"{i['round']} (B = {i['batch_size']}, privacy.level={html.escape(str(i['privacy']))}): mean PSNR "
            f"{'∞' if i['mean_psnr'] is None else format(i['mean_psnr'], '.2f')} dB, mean SSIM {i['mean_ssim']:.3f}, "
            "label accuracy "
            f"{100 * i['label_accuracy']:.0f} %</p>"
            + (
                f'<img alt="true images above their reconstructions" src="data:image/png;base64,{image}">'
                if image
                else ""
            )
        )
    return "<h2>Gradient inversion</h2>" + "".join(parts) if parts else ""


def suite_table(suite: dict) -> str:
    """A suite's table (``results.json`` of ``plfl reproduce``) in HTML: its title, a row per cell with plfl's
    mean ± std beside the paper's value and the gap (percentage points), then its claims."""
    head = "".join(
        f"<th>{c}</th>" for c in ("setting", "method", "metric", "plfl (%)", "paper (%)", "gap", "seeds", "rounds")
    )
    rows = []
    for r in suite["rows"]:
        texts = [r["setting"], r["method"], r["metric"]]
        numbers = [
            mean_std_text(r["plfl"], r["plfl_std"], "–"),
            mean_std_text(r["paper"], r["paper_std"], "–"),
            "–" if r["gap"] is None else f"{r['gap']:+.2f}",
            r["seeds"],
            "–" if r["rounds"] is None else f"{r['rounds']}" + (" (scaled)" if r["scaled"] else ""),
        ]
        rows.append(
            "<tr>"
            + "".join(f"<td>{html.escape(str(c))}</td>" for c in texts)
            + "".join(f'<td class="num">{html.escape(str(n))}</td>' for n in numbers)
            + "</tr>"
        )
    claims = "".join(
        f"<li>{html.escape(claim)}: " + "; ".join(html.escape(line) for line in lines) + "</li>"
        for claim, lines in suite["claims"].items()
    )
    return (
        f"<h2>{html.escape(suite['title'])}</h2><p>{html.escape(suite['paper'])}</p>"
        f"<table><tr>{head}</tr>{''.join(rows)}</table>" + (f"<ul>{claims}</ul>" if claims else "")
    )


def figure_div(fig: go.Figure, index: int) -> str:
    """The figure as a <div> and its drawing script, without plotly.js (the page holds it once)."""
    return pio.to_html(
        fig,
        full_html=False,
        include_plotlyjs=False,
        div_id=f"figure-{index}",
        config={"displaylogo": False, "responsive": True},
    )


# A legend click (or double-click) in one figure shows or hides that run in every figure: each run is one
# legend group everywhere (figures.py). Only differing traces are restyled, so the echoed events stop.
SYNC_LEGENDS = """
const figures = [...document.querySelectorAll('.plotly-graph-div')];
const state = trace => trace.visible ?? true;  // true, false or 'legendonly'
for (const source of figures) {
  source.on('plotly_restyle', ([update]) => {
    if (!('visible' in update)) return;
    const shown = new Map(source.data.filter(t => t.legendgroup).map(t => [t.legendgroup, state(t)]));
    for (const target of figures) {
      const wanted = target.data.map(t => shown.has(t.legendgroup) ? shown.get(t.legendgroup) : state(t));
      const changed = [...wanted.keys()].filter(i => wanted[i] !== state(target.data[i]));
      if (changed.length) Plotly.restyle(target, {visible: changed.map(i => wanted[i])}, changed);
    }
  });
}
"""


def page_html(
    runs: list[ReportRun], figures: list[go.Figure], title: str = "plfl report", suites: list[dict] = ()
) -> str:
    """The whole page: the suites' tables (``plfl reproduce``), the runs table, then every figure; needs no
    network to open."""
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
client's own test split. Selected accuracy: at the round of highest validation accuracy (runs with
data.val_fraction); best accuracy picks the round on the test data and is optimistic. Hover for values
and each run's method, data set, seed and directory; drag to zoom. A click on a run's legend entry hides or
shows it in every figure; a double-click shows it alone.</p>
{"".join(suite_table(suite) for suite in suites)}
<div class="table">{runs_table(runs)}</div>
{inversion_section(runs)}
{divs}
<script type="text/javascript">{SYNC_LEGENDS}</script>
</body>
</html>
"""
