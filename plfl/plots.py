"""What a method asks ``plfl report`` to draw beside the figures every run gets: plain declarations, so that a
method module imports no plotting library; :mod:`plfl.report.figures` draws each for the runs that have its data.
A method lists them in its class attribute ``figures`` (a mixin's count for the methods it is part of)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass(frozen=True)
class Panel:
    """A metrics.csv ``column`` against the round, one line per run, under ``title``; ``log``: a log y axis;
    ``points``: (table, column) of ``tables/<table>.csv`` drawn as points too, one per client and round."""

    column: str
    title: str
    log: bool = False
    points: Optional[tuple[str, str]] = None


@dataclass(frozen=True)
class Panels:
    """Side-by-side :class:`Panel` s in one figure, for the runs that have a value in any of their columns; a
    panel no run has a value in is left out."""

    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class TableLines:
    """``y`` of ``tables/<table>.csv`` against the round, a line per run (colour) and value of ``group`` (dash),
    on a y axis titled ``y_title`` within ``y_range``; ``group_label`` names a group in the legend and hover."""

    title: str
    table: str
    group: str
    y: str
    y_title: str
    y_range: Optional[tuple[float, float]] = None
    group_label: str = "{}"


@dataclass(frozen=True)
class Heatmaps:
    """Per run, the last round of ``tables/<table>.csv``: a heatmap per value of ``facet`` (None: one), a row per
    value of ``row`` and a column per column named ``prefix`` + j (j = 0, 1, ...; ``column`` names what j indexes,
    by default ``row``), titled ``title`` (``{run}`` and ``{round}`` filled in); a row whose boolean ``marked``
    column is true says ``marks[1]`` in its hover text, else ``marks[0]``."""

    title: str
    table: str
    facet: Optional[str]
    row: str
    prefix: str
    value: str
    marked: Optional[str] = None
    marks: tuple[str, str] = ("", "")
    column: str = ""


Plot = Union[Panels, TableLines, Heatmaps]
