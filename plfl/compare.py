"""Comparison tables of finished runs: method × data set, mean ± std over seeds.

Two Markdown tables. Accuracy in the layout of FedALA's Table 2 (AAAI 2023):
one row per method, one column per data set, each cell the best test
accuracy (%) as mean ± std over the runs (seeds) of that method on that data
set; std is the population standard deviation (NumPy's default, as PFLlib
reports it). Costs below it, one row per (method, data set): mean seconds
per training round and scalars sent per round over the same runs. Costs are
never averaged across data sets: a data set's model and clients set them
(one method's seconds per round on MNIST's CNN and on digits' MLP differ
by orders of magnitude), and a row per pair keeps two cost columns where
data sets as columns would need two per data set.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from plfl.config import DEFAULT_NUM_CLIENTS
from plfl.errors import PlflError


@dataclass
class RunRecord:
    """What a comparison needs of one finished run."""

    method: str
    dataset: str  # data.source, with the PFLlib directory's name for pfllib data
    seed: int
    best_accuracy: float  # fraction in [0, 1]
    seconds_per_round: float
    params_sent_per_round: float  # scalars


def read_run(run_dir: Path) -> RunRecord:
    """The record of ``run_dir`` (its config.yaml and summary.json).

    Raises:
        PlflError: ``run_dir`` lacks either file, or the run did not complete.
    """
    config, summary = run_dir / "config.yaml", run_dir / "summary.json"
    if not (config.is_file() and summary.is_file()):
        raise PlflError(
            f"{run_dir} is not a plfl run directory (it needs config.yaml and summary.json); "
            "pass runs/<name>/<time>/ or a folder holding such directories."
        )
    cfg, result = OmegaConf.load(config), json.loads(summary.read_text())
    if result.get("status") != "completed":
        raise PlflError(
            f"The run in {run_dir} did not complete (status {result.get('status')!r}); "
            "leave it out of the comparison or resume it."
        )
    return RunRecord(
        cfg.method.name,
        dataset_name(cfg),
        cfg.federation.seed,
        result["best_accuracy"],
        result["seconds_per_round"],
        result["params_sent_per_round"],
    )


def dataset_name(cfg) -> str:
    """A run config's data setting: ``data.source`` (the directory's name for pfllib data) and, where plfl
    partitions the data, the partition and client count, e.g. ``mnist Dir(0.1), 20 clients``: runs of one
    source split differently are different data sets."""
    data = cfg.data
    name = data.source if data.source != "pfllib" else f"pfllib:{Path(data.root).name}"
    if "partition" not in data or (data.source == "pfllib" and not data.get("repartition", False)):
        return name  # the files' own clients
    partition = {
        "dirichlet": f"Dir({data.get('beta')})",
        "pathological": f"pathological({data.get('classes_per_client')} classes)",
        "classes": f"classes({data.get('classes_per_client')} classes)",
        "dominant": f"dominant({data.get('dominant_classes')} classes, {data.get('dominant_fraction')})",
    }.get(data.partition, data.partition)
    clients = data.get("num_clients") or DEFAULT_NUM_CLIENTS
    return f"{name} {partition}, {clients} clients"


def find_runs(paths: list[Path]) -> list[Path]:
    """Run directories in ``paths``: a path holding summary.json is one; any other is searched below."""
    runs = []
    for path in paths:
        if (path / "summary.json").is_file():
            runs.append(path)
        else:
            runs.extend(sorted(p.parent for p in path.rglob("summary.json")))
    if not runs:
        raise PlflError(
            f"No run directories (with summary.json) under {', '.join(map(str, paths))}; "
            "pass runs/<name>/<time>/ or a folder holding such directories."
        )
    return runs


def mean_std(values: list[float]) -> str:
    """``mean ± std`` of accuracies (fractions) in %, two decimals; one value: ``mean``."""
    mean = 100 * statistics.fmean(values)
    return f"{mean:.2f}" if len(values) == 1 else f"{mean:.2f} ± {100 * statistics.pstdev(values):.2f}"


def comparison_table(records: list[RunRecord]) -> str:
    """The accuracy table (methods × data sets), a blank line, and the cost table (a row per method and
    data set), both in Markdown; see the module docstring. Methods and data sets in first-seen order."""
    methods = list(dict.fromkeys(r.method for r in records))
    datasets = list(dict.fromkeys(r.dataset for r in records))
    accuracy = ["| method | " + " | ".join(datasets) + " |", "| --- " * (len(datasets) + 1) + "|"]
    costs = ["| method | data set | s/round | params sent/round | n |", "| --- " * 5 + "|"]
    for method in methods:
        cells = []
        for dataset in datasets:
            runs = [r for r in records if r.method == method and r.dataset == dataset]
            cells.append(f"{mean_std([r.best_accuracy for r in runs])} (n={len(runs)})" if runs else "–")
            if runs:
                seconds = statistics.fmean(r.seconds_per_round for r in runs)
                params = statistics.fmean(r.params_sent_per_round for r in runs)
                costs.append(f"| {method} | {dataset} | {seconds:,.2f} | {params:,.0f} | {len(runs)} |")
        accuracy.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(accuracy + [""] + costs)
