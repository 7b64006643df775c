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
the runs has the data the panel needs (method-specific panels).
"""

from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go
from plotly.subplots import make_subplots

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
    """Test accuracy (metrics.csv ``accuracy``: correct / samples over all clients) per round, one line per run."""
    fig = go.Figure()
    for run in runs:
        rounds, acc = run.series("accuracy")
        fig.add_trace(_line(runs, run, rounds, [100 * a for a in acc], hover=PERCENT))
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
    per evaluated round, side by side on one scale: the ⌈10 %⌉ rule of plfl.metrics.tail_means."""
    fig = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        horizontal_spacing=0.04,
        subplot_titles=["worst 10 % of clients", "top 10 % of clients"],
    )
    for run in runs:
        rounds, worst = run.series("worst10_accuracy")
        fig.add_trace(_line(runs, run, rounds, [100 * w for w in worst], "worst 10 % ", hover=PERCENT), row=1, col=1)
        rounds, _, top = run.tail_series()
        fig.add_trace(
            _line(runs, run, rounds, [100 * t for t in top], "top 10 % ", hover=PERCENT, show_legend=False),
            row=1,
            col=2,
        )
    return _layout(fig, "Worst-10 % and top-10 % client accuracy", "mean client accuracy (%)")


def seconds_figure(runs: list[ReportRun]) -> go.Figure:
    """Wall-clock seconds of every round (metrics.csv ``seconds``; round 0 is only evaluation), log axis."""
    fig = go.Figure()
    for run in runs:
        rounds, seconds = _positive(*run.series("seconds"))
        fig.add_trace(_line(runs, run, rounds, seconds, hover="%{y:.3g} s"))
    fig = _layout(fig, "Seconds per round", "seconds")
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
    """The global model's accuracy on the union of test splits (``global_accuracy``, solid) against the
    personalized models' accuracy (dotted, no legend entry of its own), for runs whose method has a global
    model (FedFTHA, Self-FL)."""
    own = [r for r in runs if r.has("global_accuracy")]
    if not own:
        return None
    fig = go.Figure()
    for run in own:
        rounds, acc = run.series("global_accuracy")
        fig.add_trace(_line(runs, run, rounds, [100 * a for a in acc], "global model ", hover=PERCENT))
        rounds, acc = run.series("accuracy")
        fig.add_trace(_line(runs, run, rounds, [100 * a for a in acc], "personalized ", "dot", PERCENT, False))
    return _layout(fig, "Global-model accuracy (solid) and personalized accuracy (dotted)", "accuracy (%)")


def _panels(runs: list[ReportRun], own: list[ReportRun], title: str, panels: list[tuple[str, str, bool]]) -> go.Figure:
    """Side-by-side panels of metrics.csv columns, given as (column, panel title, log y axis); a column that no
    run has a value in (a run too short for it) gets no panel."""
    panels = [p for p in panels if any(run.has(p[0]) for run in own)]
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[p[1] for p in panels])
    for col, (column, name, log) in enumerate(panels, start=1):
        for run in own:
            rounds, values = run.series(column)
            fig.add_trace(_line(runs, run, rounds, values, f"{name} ", show_legend=col == 1), row=1, col=col)
        if log:
            fig.update_yaxes(type="log", exponentformat="power", row=1, col=col)
    return _layout(fig, title, "")


def ala_figure(runs: list[ReportRun]) -> Optional[go.Figure]:
    """FedALA's Adaptive Local Aggregation: mean ALA weight (``ala_weight_mean``, over clients and
    weight entries) and mean ALA training epochs (``ala_epochs_mean``) per round."""
    own = [r for r in runs if r.has("ala_weight_mean")]
    if not own:
        return None
    return _panels(
        runs,
        own,
        "ALA weight statistics",
        [("ala_weight_mean", "mean ALA weight", False), ("ala_epochs_mean", "mean ALA epochs", False)],
    )


def selffl_figure(runs: list[ReportRun]) -> Optional[go.Figure]:
    """Self-FL: inter-client variance σ_0² (``selffl_sigma0_sq``), client variances σ_m²
    (``selffl_sigma_sq_mean``, line) and local steps l_m (``selffl_local_steps_mean``, line) per round;
    the clients' own σ_m² and l_m from tables/selffl_clients.csv as points."""
    own = [r for r in runs if r.has("selffl_sigma0_sq") or r.has("selffl_sigma_sq_mean")]
    if not own:
        return None
    panels = [
        ("selffl_sigma0_sq", "σ₀² (inter-client variance)", True),
        ("selffl_sigma_sq_mean", "σ_m² (clients; line: mean)", True),
        ("selffl_local_steps_mean", "l_m (local steps; line: mean)", False),
    ]
    fig = _panels(runs, own, "Self-FL: variances and local steps", panels)
    drawn = [column for column, _, _ in panels if any(run.has(column) for run in own)]  # _panels' subplots
    for run in own:
        rows = run.tables.get("selffl_clients", [])
        for line, column in (("selffl_sigma_sq_mean", "sigma_sq"), ("selffl_local_steps_mean", "local_steps")):
            points = [r for r in rows if r.get(column) is not None]
            if points and line in drawn:
                fig.add_trace(
                    go.Scatter(
                        x=[r["round"] for r in points],
                        y=[r[column] for r in points],
                        mode="markers",
                        legendgroup=run.label,
                        showlegend=False,
                        opacity=0.5,
                        marker=dict(color=colour(runs, run), size=4, symbol="circle-open"),
                        customdata=[r["client"] for r in points],
                        name=run.label,
                        hovertemplate=f"<b>{run.label}</b><br>{run.details}<br>round %{{x}}, "
                        "client %{customdata}: %{y:.4g}<extra></extra>",
                    ),
                    row=1,
                    col=drawn.index(line) + 1,
                )
    return fig


DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")


def partialfed_figure(runs: list[ReportRun]) -> Optional[go.Figure]:
    """PartialFed-Adaptive's learned strategy: per layer, the clients' mean probability of loading it from the
    global model (tables/partialfed_strategy.csv), one line per layer (dash) and run (colour)."""
    own = [r for r in runs if r.tables.get("partialfed_strategy")]
    if not own:
        return None
    fig = go.Figure()
    for run in own:
        rows = run.tables["partialfed_strategy"]
        for i, layer in enumerate(dict.fromkeys(r["layer"] for r in rows)):
            points = [r for r in rows if r["layer"] == layer]
            fig.add_trace(
                _line(
                    runs,
                    run,
                    [r["round"] for r in points],
                    [r["global_probability"] for r in points],
                    f"layer {layer}: ",
                    DASHES[i % len(DASHES)],
                    "%{y:.3f}",
                    show_legend=i == 0,
                )
            )
    fig = _layout(fig, "PartialFed: probability of loading each layer from the global model", "probability")
    fig.update_yaxes(range=[0, 1])
    return fig


def aggregation_weight_figure(run: ReportRun) -> Optional[go.Figure]:
    """pFedLA / HeurpFedLA aggregation weights α_i^{l,j} at the last round in
    tables/aggregation_weights.csv (pFedLA's Fig. 6): one heatmap per layer l, client i (rows) ×
    client j (columns); each row sums to 1. Layers HeurpFedLA keeps local at client i are marked
    in the hover text. None without the table."""
    last = run.last_table_round("aggregation_weights")
    if last is None:
        return None
    rows = [r for r in run.tables["aggregation_weights"] if r["round"] == last]
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    clients = sorted({r["client"] for r in rows})
    columns = sorted((k for k in rows[0] if k.startswith("w") and k[1:].isdigit()), key=lambda k: int(k[1:]))
    fig = make_subplots(
        rows=1, cols=len(layers), subplot_titles=[f"layer {layer}" for layer in layers], horizontal_spacing=0.06
    )
    top = max(r[c] for r in rows for c in columns)
    for col, layer in enumerate(layers, start=1):
        by_client = {r["client"]: r for r in rows if r["layer"] == layer}
        z = [[by_client[i][c] for c in columns] for i in clients]
        kept = [["kept local" if by_client[i].get("retained") else "aggregated"] * len(columns) for i in clients]
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=[int(c[1:]) for c in columns],
                y=clients,
                customdata=kept,
                zmin=0,
                zmax=top,
                colorscale="Viridis",
                showscale=col == 1,
                colorbar=dict(title="α"),
                hovertemplate="client i=%{y}, j=%{x}: α=%{z:.3f} (%{customdata})<extra></extra>",
            ),
            row=1,
            col=col,
        )
        fig.update_xaxes(title_text="client j", dtick=1, row=1, col=col)
        fig.update_yaxes(title_text="client i" if col == 1 else "", dtick=1, autorange="reversed", row=1, col=col)
    fig.update_layout(
        title=f"Aggregation weights α of {run.label}, round {last}",
        template="plotly_white",
        height=460,
        margin=dict(t=80, b=40),
    )
    return fig


def all_figures(runs: list[ReportRun]) -> list[go.Figure]:
    """Every panel that the runs have data for, in page order."""
    figures = [
        accuracy_figure(runs),
        client_distribution_figure(runs),
        tail_figure(runs),
        seconds_figure(runs),
        communication_figure(runs),
        global_accuracy_figure(runs),
        ala_figure(runs),
        selffl_figure(runs),
        partialfed_figure(runs),
    ]
    figures += [aggregation_weight_figure(run) for run in runs]
    return [f for f in figures if f is not None]
