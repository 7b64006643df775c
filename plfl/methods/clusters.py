"""Cluster assignments, as the clustered methods (IFCA, CFL) report them: each round's table
``tables/cluster_assignments.csv`` and the clients-by-clusters heatmap that ``plfl report`` draws of its last round.

A row of the table is a client: ``client``, its ``cluster`` j and a 0/1 column ``c<j>`` per cluster (1 in its own).
A method whose number of clusters grows (CFL) writes as many ``c<j>`` columns as it has clusters that round; the
file's columns are the union over the rounds, so an earlier round leaves the later clusters' cells empty.
"""

from __future__ import annotations

from typing import Any

from plfl.plots import Heatmaps

TABLE = "cluster_assignments"

# The heatmap of the last round's table: a row per client, a column per cluster, 1 where the client belongs.
ASSIGNMENTS_HEATMAP = Heatmaps(
    "Cluster assignments of {run}, round {round}",
    TABLE,
    facet=None,
    row="client",
    prefix="c",
    value="assigned",
    column="cluster",
)


def assignments_table(assignments: list[int], clusters: int) -> dict[str, list[dict[str, Any]]]:
    """The round's table (for ``round_tables``), a row per client: client i's cluster ``assignments[i]`` and a 0/1
    column ``c<j>`` for each j < ``clusters``.

    Raises:
        ValueError: an assignment outside 0..clusters − 1.
    """
    if any(not 0 <= j < clusters for j in assignments):
        raise ValueError(f"cluster assignments {assignments} outside 0..{clusters - 1}")
    rows = [
        {"client": i, "cluster": j, **{f"c{c}": int(c == j) for c in range(clusters)}}
        for i, j in enumerate(assignments)
    ]
    return {TABLE: rows}
