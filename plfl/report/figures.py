"""Plotly figures of finished runs, one function per panel.

Accuracies (fractions in [0, 1] in the run files) are drawn in %. Each
function returns a ``plotly.graph_objects.Figure``, or None when none of the
runs has the data the panel needs (method-specific panels). A run keeps its
colour in every panel.
"""

from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from plfl.report.runs import ReportRun

PALETTE = qualitative.Plotly + qualitative.Dark24
PERCENT = "%{y:.2f} %"


def colour(runs: list[ReportRun], run: ReportRun) -> str:
    """The run's colour: by its position among the report's runs."""
    return PALETTE[runs.index(run) % len(PALETTE)]


def _layout(fig: go.Figure, title: str, yaxis: str, height: int = 440) -> go.Figure:
    fig.update_layout(title=title, template="plotly_white", height=height, hovermode="x unified",
                      legend=dict(orientation="h", yanchor="top", y=-0.18, xanchor="left", x=0),
                      margin=dict(t=60, b=40))
    last = max((x for trace in fig.data for x in (trace.x or ())), default=0)
    # Integer ticks: plotly's automatic step goes below 1 over a few rounds.
    fig.update_xaxes(title_text="round", rangemode="tozero", dtick=1 if last <= 12 else None)
    fig.update_yaxes(title_text=yaxis)
    return fig


def _line(runs: list[ReportRun], run: ReportRun, x: list, y: list, name: str, dash: str = "solid",
          hover: str = "%{y:.4g}", show_legend: bool = True) -> go.Scatter:
    return go.Scatter(x=x, y=y, name=name, mode="lines+markers", legendgroup=run.label, showlegend=show_legend,
                      line=dict(color=colour(runs, run), dash=dash), marker=dict(size=5),
                      hovertemplate=f"{hover}<extra>{name}</extra>")


def accuracy_figure(runs: list[ReportRun]) -> go.Figure:
    """Test accuracy (metrics.csv ``accuracy``: correct / samples over all clients) per round, one line per run."""
    fig = go.Figure()
    for run in runs:
        rounds, acc = run.series("accuracy")
        fig.add_trace(_line(runs, run, rounds, [100 * a for a in acc], run.label, hover=PERCENT))
    return _layout(fig, "Test accuracy per round", "accuracy (%)")


def client_distribution_figure(runs: list[ReportRun]) -> go.Figure:
    """Per-client accuracy at each run's best round (clients.csv), a box with every client as a point
    (the Self-FL paper's Fig. 3 as a distribution per run)."""
    fig = go.Figure()
    for run in runs:
        best = run.summary.get("best_round")
        accuracies = run.client_accuracies(best) if best is not None else []
        name = run.label.replace(": ", "<br>", 1).replace(", ", "<br>") + f"<br>round {best}"
        fig.add_trace(go.Box(y=[100 * a for a in accuracies], name=name,
                             boxpoints="all", jitter=0.4, pointpos=0, boxmean=True,
                             marker=dict(color=colour(runs, run), size=5), line=dict(color=colour(runs, run)),
                             hovertemplate="%{y:.2f} %<extra></extra>"))
    fig.update_layout(title="Client accuracy at the best round", template="plotly_white", height=460,
                      showlegend=False, margin=dict(t=60, b=40))
    fig.update_yaxes(title_text="client accuracy (%)")
    fig.update_xaxes(tickangle=0, automargin=True)
    return fig


def tail_figure(runs: list[ReportRun]) -> go.Figure:
    """Worst-10 % (metrics.csv ``worst10_accuracy``, solid) and top-10 % (from clients.csv, dashed)
    mean client accuracy per evaluated round: the ⌈10 %⌉ rule of plfl.metrics.tail_means."""
    fig = go.Figure()
    for run in runs:
        rounds, worst = run.series("worst10_accuracy")
        fig.add_trace(_line(runs, run, rounds, [100 * w for w in worst], f"{run.label}: worst 10 %", hover=PERCENT))
        rounds, _, top = run.tail_series()
        fig.add_trace(_line(runs, run, rounds, [100 * t for t in top], f"{run.label}: top 10 %", "dash", PERCENT))
    return _layout(fig, "Worst-10 % and top-10 % client accuracy", "mean client accuracy (%)")


def seconds_figure(runs: list[ReportRun]) -> go.Figure:
    """Wall-clock seconds of every round (metrics.csv ``seconds``; round 0 is only evaluation)."""
    fig = go.Figure()
    for run in runs:
        rounds, seconds = run.series("seconds")
        fig.add_trace(_line(runs, run, rounds, seconds, run.label, hover="%{y:.2f} s"))
    return _layout(fig, "Seconds per round", "seconds")


def communication_figure(runs: list[ReportRun]) -> go.Figure:
    """Bytes the server sent (solid) and received (dashed) per round
    (metrics.csv ``bytes_sent``, ``bytes_received``)."""
    fig = go.Figure()
    for run in runs:
        rounds, sent = run.series("bytes_sent")
        fig.add_trace(_line(runs, run, rounds, sent, f"{run.label}: sent", hover="%{y:.4s}B"))
        rounds, received = run.series("bytes_received")
        fig.add_trace(_line(runs, run, rounds, received, f"{run.label}: received", "dash", "%{y:.4s}B"))
    fig = _layout(fig, "Bytes sent and received by the server per round", "bytes")
    fig.update_yaxes(tickformat="~s", ticksuffix="B", rangemode="tozero")
    return fig


def global_accuracy_figure(runs: list[ReportRun]) -> Optional[go.Figure]:
    """The global model's accuracy on the union of test splits (``global_accuracy``, solid) against the
    personalized models' accuracy (dotted), for runs whose method has a global model (FedFTHA, Self-FL)."""
    own = [r for r in runs if r.has("global_accuracy")]
    if not own:
        return None
    fig = go.Figure()
    for run in own:
        rounds, acc = run.series("global_accuracy")
        fig.add_trace(_line(runs, run, rounds, [100 * a for a in acc], f"{run.label}: global model", hover=PERCENT))
        rounds, acc = run.series("accuracy")
        fig.add_trace(_line(runs, run, rounds, [100 * a for a in acc], f"{run.label}: personalized", "dot", PERCENT))
    return _layout(fig, "Global-model accuracy", "accuracy (%)")


def _panels(runs: list[ReportRun], own: list[ReportRun], title: str,
            panels: list[tuple[str, str, bool]]) -> go.Figure:
    """Side-by-side panels of metrics.csv columns, given as (column, panel title, log y axis)."""
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[p[1] for p in panels])
    for col, (column, _, log) in enumerate(panels, start=1):
        for run in own:
            rounds, values = run.series(column)
            fig.add_trace(_line(runs, run, rounds, values, run.label, show_legend=col == 1), row=1, col=col)
        if log:
            fig.update_yaxes(type="log", exponentformat="power", row=1, col=col)
    fig = _layout(fig, title, "")
    fig.update_layout(hovermode="closest")
    return fig


def ala_figure(runs: list[ReportRun]) -> Optional[go.Figure]:
    """FedALA's Adaptive Local Aggregation: mean ALA weight (``ala_weight_mean``, over clients and
    weight entries) and mean ALA training epochs (``ala_epochs_mean``) per round."""
    own = [r for r in runs if r.has("ala_weight_mean")]
    if not own:
        return None
    return _panels(runs, own, "ALA weight statistics",
                   [("ala_weight_mean", "mean ALA weight", False), ("ala_epochs_mean", "mean ALA epochs", False)])


def selffl_figure(runs: list[ReportRun]) -> Optional[go.Figure]:
    """Self-FL: inter-client variance σ_0² (``selffl_sigma0_sq``), client variances σ_m²
    (``selffl_sigma_sq_mean``, line) and local steps l_m (``selffl_local_steps_mean``, line) per round;
    the clients' own σ_m² and l_m from tables/selffl_clients.csv as points."""
    own = [r for r in runs if r.has("selffl_sigma0_sq") or r.has("selffl_sigma_sq_mean")]
    if not own:
        return None
    fig = _panels(runs, own, "Self-FL: variances and local steps",
                  [("selffl_sigma0_sq", "σ₀² (inter-client variance)", True),
                   ("selffl_sigma_sq_mean", "σ_m² (clients; line: mean)", True),
                   ("selffl_local_steps_mean", "l_m (local steps; line: mean)", False)])
    for run in own:
        rows = run.tables.get("selffl_clients", [])
        for col, column in ((2, "sigma_sq"), (3, "local_steps")):
            points = [r for r in rows if r.get(column) is not None]
            if points:
                fig.add_trace(go.Scatter(x=[r["round"] for r in points], y=[r[column] for r in points],
                                         mode="markers", legendgroup=run.label, showlegend=False, opacity=0.5,
                                         marker=dict(color=colour(runs, run), size=4, symbol="circle-open"),
                                         customdata=[r["client"] for r in points], name=f"{run.label}: clients",
                                         hovertemplate="client %{customdata}: %{y:.4g}<extra></extra>"),
                              row=1, col=col)
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
    fig = make_subplots(rows=1, cols=len(layers), subplot_titles=[f"layer {layer}" for layer in layers],
                        horizontal_spacing=0.06)
    top = max(r[c] for r in rows for c in columns)
    for col, layer in enumerate(layers, start=1):
        by_client = {r["client"]: r for r in rows if r["layer"] == layer}
        z = [[by_client[i][c] for c in columns] for i in clients]
        kept = [["kept local" if by_client[i].get("retained") else "aggregated"] * len(columns) for i in clients]
        fig.add_trace(go.Heatmap(z=z, x=[int(c[1:]) for c in columns], y=clients, customdata=kept,
                                 zmin=0, zmax=top, colorscale="Viridis", showscale=col == 1,
                                 colorbar=dict(title="α"),
                                 hovertemplate="client i=%{y}, j=%{x}: α=%{z:.3f} (%{customdata})<extra></extra>"),
                      row=1, col=col)
        fig.update_xaxes(title_text="client j", dtick=1, row=1, col=col)
        fig.update_yaxes(title_text="client i" if col == 1 else "", dtick=1, autorange="reversed", row=1, col=col)
    fig.update_layout(title=f"Aggregation weights α of {run.label}, round {last}", template="plotly_white",
                      height=460, margin=dict(t=80, b=40))
    return fig


def all_figures(runs: list[ReportRun]) -> list[go.Figure]:
    """Every panel that the runs have data for, in page order."""
    figures = [accuracy_figure(runs), client_distribution_figure(runs), tail_figure(runs), seconds_figure(runs),
               communication_figure(runs), global_accuracy_figure(runs), ala_figure(runs), selffl_figure(runs)]
    figures += [aggregation_weight_figure(run) for run in runs]
    return [f for f in figures if f is not None]
