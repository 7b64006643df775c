"""Plotly figures of finished runs, one function per panel.

Accuracies (fractions in [0, 1] in the run files) are drawn in %; seconds
and bytes on log axes when they span ten times or more, so a run of 0.3 s per
round stays readable beside one of 100 s. The round axis leaves half a round
of room at both ends, so a one-round run is not drawn onto the axis beside a
long one. Each line's legend entry is its run's short label (see
runs.label_runs); method, data set, seed and directory are in its hover
text. A run keeps its colour and legend group (its label) in every panel,
which the page uses to show or hide a run in all figures at once. Each
function returns a ``plotly.graph_objects.Figure``, or None when none of
the runs has the data the panel needs (method-specific panels). A method's own
figures are declared by the method (:mod:`plfl.plots`) and drawn here by kind.
"""

from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from plfl.plots import Heatmaps, Panels, Plot, TableLines
from plfl.report.runs import ReportRun

# 20 colours that stay apart on a white page: picked greedily, each the farthest (CIE L*a*b* distance) from those
# before it, among plotly's qualitative palettes' colours dark enough to read (L* <= 78), plotly's first four
# first. Any two differ by at least 21 ΔE (plotly's default 10 + Dark24 by 9).
PALETTE = (
    "#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#222A2A", "#BCBD22", "#00B5F7", "#FF0092", "#B279A2", "#FF9900",
    "#1CA71C", "#511CFB", "#85660D", "#620042", "#FE00FA", "#0D2A63", "#72B7B2", "#FF97FF", "#E48F72", "#862A16",
)  # fmt: skip
PERCENT = "%{y:.2f} %"
BYTES = "%{y:.4s}B"


def colour(runs: list[ReportRun], run: ReportRun) -> str:
    """The run's colour: by its position among the report's runs."""
    return PALETTE[runs.index(run) % len(PALETTE)]


def _layout(fig: go.Figure, title: str, yaxis: str) -> go.Figure:
    """Title, axes, and a legend of one short line per run at the right, where the figure grows to fit it."""
    entries = sum(trace.showlegend is not False for trace in fig.data)
    fig.update_layout(
        title=title,
        template="plotly_white",
        height=max(440, 160 + 20 * entries),
        hovermode="closest",
        legend=dict(tracegroupgap=0, y=1, yanchor="top"),
        margin=dict(t=80, b=50),
    )
    last = max((x for trace in fig.data for x in (trace.x or ())), default=0)
    # Integer ticks: plotly's automatic step goes below 1 over a few rounds.
    fig.update_xaxes(title_text="round", range=[-0.5, last + 0.5], dtick=1 if last <= 12 else None)
    fig.update_layout(yaxis_title_text=yaxis)  # the first (left) panel's axis
    return fig


def _line(
    runs: list[ReportRun],
    run: ReportRun,
    x: list,
    y: list,
    what: str = "",
    dash: str = "solid",
    hover: str = "%{y:.4g}",
    show_legend: bool = True,
) -> go.Scatter:
    """The run's line; ``what`` names the quantity in the hover text where a panel shows two."""
    return go.Scatter(
        x=x,
        y=y,
        name=run.label,
        mode="lines+markers",
        legendgroup=run.label,
        showlegend=show_legend,
        line=dict(color=colour(runs, run), dash=dash),
        marker=dict(size=5),
        hovertemplate=f"<b>{run.label}</b><br>{run.details}<br>round %{{x}}: {what}{hover}<extra></extra>",
    )


def _value_axis(fig: go.Figure, tickformat: str = "") -> None:
    """Log y axes where a figure's values span ten times or more (one tick label per decade, or at 1, 2 and 5
    within three decades, where plotly would label every digit of a narrow range), linear ones otherwise."""
    values = [v for trace in fig.data for v in (trace.y or ()) if v is not None and v > 0]
    span = max(values) / min(values) if values else 1.0
    if span < 10:
        fig.update_yaxes(type="linear", tickformat=tickformat, rangemode="tozero")
    else:
        fig.update_yaxes(type="log", tickformat=tickformat, dtick=1 if span >= 1000 else "D2")


def _positive(rounds: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    """The points a log axis can show, values > 0: zero bytes (a method that sends nothing) have no place on it."""
    kept = [(r, v) for r, v in zip(rounds, values) if v > 0]
    return [r for r, _ in kept], [v for _, v in kept]


def accuracy_figure(runs: list[ReportRun]) -> go.Figure:
    """Test accuracy (metrics.csv ``accuracy``: correct / samples over all clients) per round, one line per run;
    runs on several data sets get a panel, and an accuracy axis, per data set."""
    datasets = list(dict.fromkeys(run.dataset for run in runs))
    fig = make_subplots(rows=1, cols=len(datasets), subplot_titles=datasets if len(datasets) > 1 else None)
    for run in runs:
        rounds, acc = run.series("accuracy")
        fig.add_trace(
            _line(runs, run, rounds, [100 * a for a in acc], hover=PERCENT), row=1, col=datasets.index(run.dataset) + 1
        )
    return _layout(fig, "Test accuracy per round", "accuracy (%)")


def client_distribution_figure(runs: list[ReportRun]) -> go.Figure:
    """Per-client accuracy at each run's best round (clients.csv): a horizontal box per run (one row per
    run, so that many runs keep readable labels) with every client as a point (the Self-FL paper's Fig. 3
    as a distribution per run)."""
    fig = go.Figure()
    for run in runs:
        best = run.summary.get("best_round")
        accuracies = run.client_accuracies(best) if best is not None else []
        fig.add_trace(
            go.Box(
                x=[100 * a for a in accuracies],
                name=f"{run.label} (round {best})",
                legendgroup=run.label,
                orientation="h",
                boxpoints="all",
                jitter=0.4,
                pointpos=0,
                boxmean=True,
                marker=dict(color=colour(runs, run), size=5),
                line=dict(color=colour(runs, run)),
                hovertemplate=f"<b>{run.label}</b><br>{run.details}<br>"
                f"a client at round {best}: %{{x:.2f}} %<extra></extra>",
            )
        )
    fig.update_layout(
        title="Client accuracy at the best round",
        template="plotly_white",
        height=max(300, 120 + 32 * len(runs)),
        showlegend=False,
        margin=dict(t=60, b=40),
    )
    fig.update_xaxes(title_text="client accuracy (%)")
    fig.update_yaxes(autorange="reversed", automargin=True)  # the runs top to bottom in the table's order
    return fig


def tail_figure(runs: list[ReportRun]) -> go.Figure:
    """Worst-10 % (metrics.csv ``worst10_accuracy``) and top-10 % (from clients.csv) mean client accuracy
    per evaluated round, side by side on one scale: the ⌈10 %⌉ rule of plfl.metrics.tail_means; and beside
    them the sample-weighted accuracy of the ⌈10 %⌉ largest clients (``largest10_accuracy``, Self-FL's
    Table 1) for the runs whose metrics.csv has it. Runs written before plfl wrote that column have no line
    in that panel, and where none of the runs has it the panel is left out."""
    largest = [run for run in runs if run.has("largest10_accuracy")]
    titles = ["worst 10 % of clients", "top 10 % of clients"]
    if largest:
        titles.append("largest 10 % of clients (weighted)")
    fig = make_subplots(rows=1, cols=len(titles), shared_yaxes=True, horizontal_spacing=0.04, subplot_titles=titles)
    for run in runs:
        rounds, worst = run.series("worst10_accuracy")
        fig.add_trace(_line(runs, run, rounds, [100 * w for w in worst], "worst 10 % ", hover=PERCENT), row=1, col=1)
        rounds, _, top = run.tail_series()
        fig.add_trace(
            _line(runs, run, rounds, [100 * t for t in top], "top 10 % ", hover=PERCENT, show_legend=False),
            row=1,
            col=2,
        )
    for run in largest:
        rounds, values = run.series("largest10_accuracy")
        fig.add_trace(
            _line(runs, run, rounds, [100 * v for v in values], "largest 10 % ", hover=PERCENT, show_legend=False),
            row=1,
            col=3,
        )
    if largest:
        return _layout(fig, "Worst-10 %, top-10 % and largest-10 % client accuracy", "accuracy (%)")
    return _layout(fig, "Worst-10 % and top-10 % client accuracy", "mean client accuracy (%)")


def seconds_figure(runs: list[ReportRun]) -> go.Figure:
    """Wall-clock seconds of every round (metrics.csv ``seconds``; round 0 is only evaluation) and, for runs with
    simulated client systems, the simulated seconds (``simulated_seconds``, dashed), log axis."""
    fig = go.Figure()
    for run in runs:
        rounds, seconds = _positive(*run.series("seconds"))
        fig.add_trace(_line(runs, run, rounds, seconds, "measured ", hover="%{y:.3g} s"))
        if run.has("simulated_seconds"):
            rounds, seconds = _positive(*run.series("simulated_seconds"))
            fig.add_trace(_line(runs, run, rounds, seconds, "simulated ", "dash", "%{y:.3g} s", False))
    simulated = any(run.has("simulated_seconds") for run in runs)
    fig = _layout(fig, "Seconds per round" + (" (simulated: dashed)" if simulated else ""), "seconds")
    _value_axis(fig)
    return fig


def communication_figure(runs: list[ReportRun]) -> go.Figure:
    """Bytes the server sent (metrics.csv ``bytes_sent``) and received (``bytes_received``) per round, side by
    side on one log axis (sent and received are often equal: overlaid, one line would hide the other).
    Rounds with zero bytes are left out (a log axis has no 0; the runs table shows the means)."""
    fig = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        horizontal_spacing=0.04,
        subplot_titles=["sent to clients", "received from clients"],
    )
    for col, (column, what) in enumerate((("bytes_sent", "sent "), ("bytes_received", "received ")), start=1):
        for run in runs:
            rounds, values = _positive(*run.series(column))
            fig.add_trace(_line(runs, run, rounds, values, what, hover=BYTES, show_legend=col == 1), row=1, col=col)
    fig = _layout(fig, "Bytes sent and received by the server per round", "bytes")
    _value_axis(fig, tickformat="~s")  # 10k, 1M
    return fig


def global_accuracy_figure(runs: list[ReportRun]) -> Optional[go.Figure]:
    """The global model's accuracy on the clients' test splits (``global_accuracy``, solid) against the
    personalized models' accuracy (dotted), for runs whose method has a global model (FedFTHA, Self-FL, ...)."""
    title = "Global-model accuracy (solid) and personalized accuracy (dotted)"
    return _against_accuracy(runs, "global_accuracy", "global model", "personalized", title)


def unseen_accuracy_figure(runs: list[ReportRun]) -> Optional[go.Figure]:
    """The unseen clients' accuracy (``unseen_accuracy``, solid) against the participating clients' (dotted), for
    runs with ``federation.unseen_clients``: the participation gap is the distance between the two."""
    title = "Unseen clients' accuracy (solid) and participating clients' accuracy (dotted)"
    return _against_accuracy(runs, "unseen_accuracy", "unseen clients", "participating", title)


def _against_accuracy(runs: list[ReportRun], column: str, what: str, accuracy: str, title: str) -> Optional[go.Figure]:
    """``column`` (a fraction, solid; ``what`` in the hover text) beside ``accuracy`` (dotted, no legend entry of
    its own; ``accuracy`` in the hover text) per round, for the runs that have it; None when none has."""
    own = [r for r in runs if r.has(column)]
    if not own:
        return None
    fig = go.Figure()
    for run in own:
        rounds, acc = run.series(column)
        fig.add_trace(_line(runs, run, rounds, [100 * a for a in acc], f"{what} ", hover=PERCENT))
        rounds, acc = run.series("accuracy")
        fig.add_trace(_line(runs, run, rounds, [100 * a for a in acc], f"{accuracy} ", "dot", PERCENT, False))
    return _layout(fig, title, "accuracy (%)")


def loss_figure(runs: list[ReportRun]) -> go.Figure:
    """Test loss (metrics.csv ``test_loss``, solid) and training loss (``train_loss``, dotted) per round."""
    fig = go.Figure()
    for run in runs:
        fig.add_trace(_line(runs, run, *run.series("test_loss"), "test loss "))
        fig.add_trace(_line(runs, run, *run.series("train_loss"), "training loss ", "dot", show_legend=False))
    fig = _layout(fig, "Test loss (solid) and training loss (dotted) per round", "cross-entropy")
    _value_axis(fig)
    return fig


def panels_figure(runs: list[ReportRun], spec: Panels) -> Optional[go.Figure]:
    """A method's side-by-side panels of metrics.csv columns (:class:`plfl.plots.Panels`) for the runs that have
    a value in one of them; a column that no run has a value in (a run too short for it) gets no panel; a
    panel's ``points`` are its table's per-client values."""
    own = [r for r in runs if any(r.has(p.column) for p in spec.panels)]
    panels = [p for p in spec.panels if any(run.has(p.column) for run in own)]
    if not own:
        return None
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[p.title for p in panels])
    for col, panel in enumerate(panels, start=1):
        for run in own:
            rounds, values = run.series(panel.column)
            fig.add_trace(_line(runs, run, rounds, values, f"{panel.title} ", show_legend=col == 1), row=1, col=col)
            if panel.points is not None:
                table, column = panel.points
                points = [r for r in run.tables.get(table, []) if r.get(column) is not None]
                if points:
                    fig.add_trace(_client_points(runs, run, points, column), row=1, col=col)
        if panel.log:
            fig.update_yaxes(type="log", exponentformat="power", row=1, col=col)
    return _layout(fig, spec.title, "")


def _client_points(runs: list[ReportRun], run: ReportRun, rows: list[dict], column: str) -> go.Scatter:
    """The clients' values of ``column`` in a table's ``rows`` (each with round and client), as open points."""
    return go.Scatter(
        x=[r["round"] for r in rows],
        y=[r[column] for r in rows],
        mode="markers",
        legendgroup=run.label,
        showlegend=False,
        opacity=0.5,
        marker=dict(color=colour(runs, run), size=4, symbol="circle-open"),
        customdata=[r["client"] for r in rows],
        name=run.label,
        hovertemplate=f"<b>{run.label}</b><br>{run.details}<br>round %{{x}}, client %{{customdata}}: %{{y:.4g}}"
        "<extra></extra>",
    )


DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")


def table_lines_figure(runs: list[ReportRun], spec: TableLines) -> Optional[go.Figure]:
    """A method's table as lines (:class:`plfl.plots.TableLines`): per run (colour) and group (dash), the table's
    value against the round; None when no run has the table."""
    own = [r for r in runs if r.tables.get(spec.table)]
    if not own:
        return None
    fig = go.Figure()
    for run in own:
        rows = run.tables[spec.table]
        for i, group in enumerate(dict.fromkeys(r[spec.group] for r in rows)):
            points = [r for r in rows if r[spec.group] == group]
            fig.add_trace(
                _line(
                    runs,
                    run,
                    [r["round"] for r in points],
                    [r[spec.y] for r in points],
                    spec.group_label.format(group) + ": ",
                    DASHES[i % len(DASHES)],
                    "%{y:.3f}",
                    show_legend=i == 0,
                )
            )
    fig = _layout(fig, spec.title, spec.y_title)
    if spec.y_range is not None:
        fig.update_yaxes(range=list(spec.y_range))
    return fig


def heatmaps_figure(run: ReportRun, spec: Heatmaps) -> Optional[go.Figure]:
    """A method's matrices at the run's last round with the table (:class:`plfl.plots.Heatmaps`): one heatmap
    per facet value, rows × columns of the table; None without the table."""
    last = run.last_table_round(spec.table)
    if last is None:
        return None
    rows = [r for r in run.tables[spec.table] if r["round"] == last]
    facets = list(dict.fromkeys(r[spec.facet] for r in rows)) if spec.facet else [None]
    keys = sorted({r[spec.row] for r in rows})
    prefix = spec.prefix
    numbered = {int(k[len(prefix) :]): k for k in rows[0] if k.startswith(prefix) and k[len(prefix) :].isdigit()}
    columns = [numbered[j] for j in sorted(numbered)]
    titles = [f"{spec.facet} {f}" for f in facets] if spec.facet else None
    fig = make_subplots(rows=1, cols=len(facets), subplot_titles=titles, horizontal_spacing=0.06)
    column = spec.column or spec.row
    top = max(r[c] for r in rows for c in columns)
    for col, facet in enumerate(facets, start=1):
        by_row = {r[spec.row]: r for r in rows if facet is None or r[spec.facet] == facet}
        z = [[by_row[i][c] for c in columns] for i in keys]
        marks = [[spec.marks[bool(spec.marked and by_row[i].get(spec.marked))]] * len(columns) for i in keys]
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=[int(c[len(prefix) :]) for c in columns],
                y=keys,
                customdata=marks,
                zmin=0,
                zmax=top,
                colorscale="Viridis",
                showscale=col == 1,
                colorbar=dict(title=spec.value),
                hovertemplate=f"{spec.row} i=%{{y}}, {column} j=%{{x}}: {spec.value}=%{{z:.3f}} (%{{customdata}})"
                "<extra></extra>",
            ),
            row=1,
            col=col,
        )
        fig.update_xaxes(title_text=f"{column} j", dtick=1, row=1, col=col)
        fig.update_yaxes(title_text=f"{spec.row} i" if col == 1 else "", dtick=1, autorange="reversed", row=1, col=col)
    fig.update_layout(
        title=spec.title.format(run=run.label, round=last),
        template="plotly_white",
        height=460,
        margin=dict(t=80, b=40),
    )
    return fig


def declared_plots() -> list[Plot]:
    """What every method (and every part of one, ALA included) declares in its ``figures``, in method order."""
    from plfl.methods import methods  # the methods' modules: only when a report is drawn

    plots: list[Plot] = []
    for cls in methods().values():
        for part in reversed(cls.__mro__):
            plots += [plot for plot in part.__dict__.get("figures", ()) if plot not in plots]
    return plots


def method_figures(runs: list[ReportRun]) -> list[go.Figure]:
    """The figures the methods declare (:mod:`plfl.plots`), for the runs that have their data."""
    figures: list[Optional[go.Figure]] = []
    for plot in declared_plots():
        if isinstance(plot, Panels):
            figures.append(panels_figure(runs, plot))
        elif isinstance(plot, TableLines):
            figures.append(table_lines_figure(runs, plot))
        else:
            figures += [heatmaps_figure(run, plot) for run in runs]
    return [f for f in figures if f is not None]


def all_figures(runs: list[ReportRun]) -> list[go.Figure]:
    """Every panel that the runs have data for, in page order: those of every run, then the methods' own."""
    figures = [
        accuracy_figure(runs),
        client_distribution_figure(runs),
        tail_figure(runs),
        loss_figure(runs),
        seconds_figure(runs),
        communication_figure(runs),
        global_accuracy_figure(runs),
        unseen_accuracy_figure(runs),
    ]
    return [f for f in figures if f is not None] + method_figures(runs)
