"""Comparison tables of finished runs: method (and its settings) × data set, mean ± std over seeds.

Markdown tables. Accuracy in the layout of FedALA's Table 2 (AAAI 2023):
one row per method, one column per data set, each cell the best test
accuracy (%) as mean ± std over the runs (seeds) of that method on that data
set; std is the population standard deviation (NumPy's default, as PFLlib
reports it). Where the runs of a data set hold validation splits
(``data.val_fraction``, part of the data set's name), its cells are the test
accuracy at the round selected on validation instead (``selected_accuracy``),
and every column's header then says its rule (best-on-test picks the round on
the test data: optimistic). Runs of one method whose settings differ are never
averaged: a config key that takes two values among one method's runs on one
data set (a sweep's ``method.s``, ``federation.lr``, ``federation.rounds``)
splits that method into rows named by those keys (``fedala (s=80, p=2)``); the
seed, the executor and logging, checkpoint and progress keys do not. Costs below it, one
row per (row, data set): mean seconds per training round and scalars sent per
round over the same runs. Costs are never averaged across data sets: a data
set's model and clients set them (one method's seconds per round on MNIST's
CNN and on digits' MLP differ by orders of magnitude). Then, for runs whose
summary holds them, the clients at the final round in the layout of Self-FL's
Table 1 (NeurIPS 2022): the accuracy, the mean accuracy of the worst 10 % of
clients and the sample-weighted accuracy of the 10 % with the most samples.
Then, for runs with unseen clients (``federation.unseen_clients``), the
participating and the unseen clients' accuracy and the participation gap at
the accuracy table's round rule (pFL-Bench's three views). The cost table
gives the rounds run and, for runs with simulated client systems
(``federation.system``), the mean simulated seconds per round.
Runs that did not complete are listed after the tables with their status and
left out.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from plfl.config import dotted_items
from plfl.data.sources import DEFAULT_NUM_CLIENTS
from plfl.errors import PlflError

# Config keys that never make two runs different experiments: repeats, where and how a run executes, its files.
SAME_EXPERIMENT = (
    "name",
    "output_dir",
    "progress_bar",
    "checkpoint_every",
    "keep_checkpoints",
    "federation.seed",
    "federation.executor",
    "federation.cohort_size",
    "federation.cuda_graphs",
    "federation.state_offload",
    "federation.max_failed_clients",
    "trainer.accelerator",
    "trainer.devices",
)
SAME_EXPERIMENT_SECTIONS = ("data.", "logger.", "ray.")  # data: the table's columns
OWN_CLIENTS = ("leaf", "shakespeare")  # sources whose clients come with the data (one per user or role)


# An accuracy column's rule, by whether its runs have validation splits; said in its header where any column has.
RULES = {True: "selected on validation", False: "best on test"}
RULES_NOTE = (
    "Selected on validation: the test accuracy at the round of highest validation accuracy (data.val_fraction). "
    "Best on test: the highest test accuracy over the rounds, optimistic (the test data choose the round)."
)

# The clients table's columns (Self-FL's Table 1 beside the overall accuracy), RunRecord fields.
FINAL_COLUMNS = ("final_accuracy", "final_worst10", "final_largest10")


@dataclass
class RunRecord:
    """What a comparison needs of one run."""

    run_dir: Path
    method: str
    dataset: str  # see dataset_name
    seed: int
    status: str  # summary.json's: completed, failed, interrupted
    best_accuracy: Optional[float]  # fraction in [0, 1]
    seconds_per_round: Optional[float]
    params_sent_per_round: Optional[float]  # scalars
    config: dict[str, Any] = field(default_factory=dict)  # config.yaml by dotted key, e.g. "method.s"
    note: str = ""  # why an incomplete run stopped: its error or signal
    # At the final round, fractions in [0, 1]; None in runs from before summary.json held them.
    final_accuracy: Optional[float] = None
    final_worst10: Optional[float] = None
    final_largest10: Optional[float] = None
    # The test accuracy at the round of best validation accuracy; None without a validation split.
    selected_accuracy: Optional[float] = None
    summary: dict[str, Any] = field(default_factory=dict)  # summary.json as written

    def at_rule(self, key: str, selected: bool) -> Optional[float]:
        """The summary's ``key`` (e.g. ``unseen_accuracy``) at the round of the column's rule: ``selected_<key>``
        or ``best_<key>``."""
        return self.summary.get(f"{'selected' if selected else 'best'}_{key}")


def read_run(run_dir: Path) -> RunRecord:
    """The record of ``run_dir`` (its config.yaml and summary.json), whatever its status.

    Raises:
        PlflError: ``run_dir`` lacks either file.
    """
    config, summary = run_dir / "config.yaml", run_dir / "summary.json"
    if not (config.is_file() and summary.is_file()):
        raise PlflError(
            f"{run_dir} is not a plfl run directory (it needs config.yaml and summary.json); "
            "pass runs/<name>/<time>/, a folder holding such directories, or a sweep directory."
        )
    cfg, result = OmegaConf.load(config), json.loads(summary.read_text())
    return RunRecord(
        run_dir,
        cfg.method.name,
        dataset_name(cfg),
        cfg.federation.seed,
        result.get("status", "unknown"),
        result.get("best_accuracy"),
        result.get("seconds_per_round"),
        result.get("params_sent_per_round"),
        dict(dotted_items(cfg)),
        result.get("error") or result.get("signal") or "",
        result.get("final_accuracy"),
        result.get("final_worst10_accuracy"),
        result.get("final_largest10_accuracy"),
        result.get("selected_accuracy"),
        result,
    )


def dataset_name(cfg) -> str:
    """A run config's data setting: ``data.source`` (the directory's name for pfllib data) and, where plfl
    partitions the data, the partition and client count, e.g. ``mnist Dir(0.1), 20 clients``, and the validation
    split held out of training (``data.val_fraction``), e.g. ``mnist Dir(0.1), 20 clients, 10 % validation``:
    runs of one source split differently are different data sets."""
    name = _split_name(cfg.data)
    fraction = cfg.data.get("val_fraction") or 0
    return f"{name}, {100 * fraction:g} % validation" if fraction else name


def _split_name(data) -> str:
    """:func:`dataset_name` without the validation split."""
    name = {"pfllib": f"pfllib:{Path(str(data.get('root'))).name}", "hf": f"hf:{data.get('path')}"}.get(
        data.source, data.source
    )
    own = data.source in OWN_CLIENTS or (data.source == "pfllib" and not data.get("repartition", False))
    if own or "partition" not in data:
        return name  # the files' own clients
    partition = {
        "dirichlet": f"Dir({data.get('beta')})",
        "pathological": f"pathological({data.get('classes_per_client')} classes)",
        "classes": f"classes({data.get('classes_per_client')} classes)",
        "dominant": f"dominant({data.get('dominant_classes')} classes, {data.get('dominant_fraction')})",
        "fedprox": f"fedprox({data.get('classes_per_client')} classes)",
        "flwr": f"{data.get('partitioner')}({_arguments(data.get('partitioner_args'))})",
    }.get(data.partition, data.partition)
    clients = data.get("num_clients") or DEFAULT_NUM_CLIENTS
    return f"{name} {partition}, {clients} clients"


def _arguments(args: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in (args or {}).items())


def find_runs(paths: list[Path]) -> list[Path]:
    """Run directories in ``paths``: a path holding summary.json is one, a sweep directory (``trials.json``)
    holds its trials' (which live beside the sweeps folder), any other is searched below.

    Raises:
        PlflError: no run directory found.
    """
    runs = []
    for path in paths:
        if (path / "summary.json").is_file():
            runs.append(path)
        elif (path / "trials.json").is_file():
            runs.extend(sweep_runs(path))
        else:
            runs.extend(sorted(p.parent for p in path.rglob("summary.json")))
    if not runs:
        raise PlflError(
            f"No run directories (with summary.json) under {', '.join(map(str, paths))}; "
            "pass runs/<name>/<time>/, a folder holding such directories, or a sweep directory."
        )
    return list(dict.fromkeys(runs))


def sweep_runs(sweep_dir: Path) -> list[Path]:
    """The run directories of a sweep's trials, in trial order: as recorded (relative to where the sweep ran),
    else at ``<output_dir>/<name>/<time>`` beside ``<output_dir>/sweeps/`` (the sweep run from elsewhere)."""
    found = []
    for trial in json.loads((sweep_dir / "trials.json").read_text())["trials"]:
        if trial.get("run_dir"):
            recorded = Path(trial["run_dir"])
            beside = sweep_dir.parents[1] / recorded.parent.name / recorded.name
            found += [p for p in (recorded, beside) if (p / "summary.json").is_file()][:1]
    return found


def mean_std(values: list[float]) -> str:
    """``mean ± std`` of accuracies (fractions) in %, two decimals; one value: ``mean``."""
    mean = 100 * statistics.fmean(values)
    return f"{mean:.2f}" if len(values) == 1 else f"{mean:.2f} ± {100 * statistics.pstdev(values):.2f}"


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each dotted key by its last part where no other key of ``keys`` ends the same (``s`` for method.s)."""
    ends = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: end if ends.count(end) == 1 else k for k, end in zip(keys, ends)}


def value_texts(values: list[Any]) -> list[str]:
    """Each of ``values`` (config values of one key) as text, floats to the fewest significant digits, at least
    3, that keep different values apart (a sampled ``lr=0.0031622776601683794`` reads ``lr=0.00316``)."""
    floats = sorted({v for v in values if isinstance(v, float)})
    texts: dict[float, str] = {}
    for digits in range(3, 18):
        texts = {v: f"{v:.{digits}g}" for v in floats}
        if len(set(texts.values())) == len(floats):
            break
    return [texts[v] if isinstance(v, float) else str(v) for v in values]


def row_names(records: list[RunRecord]) -> dict[Path, str]:
    """Each run's row: its method, and, where the method's runs on one data set differ in a key that
    makes another experiment (not in :data:`SAME_EXPERIMENT`), those keys' values: ``fedala (s=80, p=2)``."""
    names = {}
    for method in dict.fromkeys(r.method for r in records):
        runs = [r for r in records if r.method == method]
        keys = [k for k in dict.fromkeys(k for r in runs for k in r.config) if _experiment_key(k)]
        varying = [
            k
            for k in keys
            if any(
                len({json.dumps(r.config.get(k)) for r in runs if r.dataset == d}) > 1
                for d in {r.dataset for r in runs}
            )
        ]
        short = short_keys(varying)
        texts = {k: value_texts([r.config.get(k) for r in runs]) for k in varying}
        for i, r in enumerate(runs):
            settings = ", ".join(f"{short[k]}={texts[k][i]}" for k in varying)
            names[r.run_dir] = f"{method} ({settings})" if settings else method
    return names


def _experiment_key(key: str) -> bool:
    return key not in SAME_EXPERIMENT and not key.startswith(SAME_EXPERIMENT_SECTIONS)


def comparison_table(records: list[RunRecord]) -> str:
    """The accuracy table (rows × data sets), a blank line, the cost table (a row per row and data set), both in
    Markdown, and the runs left out (not completed); see the module docstring. Methods and data sets in
    first-seen order, a method's rows together."""
    done = [r for r in records if r.status == "completed"]
    names = row_names(done)
    methods = list(dict.fromkeys(r.method for r in done))
    rows = list(dict.fromkeys(names[r.run_dir] for r in sorted(done, key=lambda r: methods.index(r.method))))
    datasets = list(dict.fromkeys(r.dataset for r in done))
    # A data set's column is selected on validation where every run of it has a validation split.
    selected = {d: all(r.selected_accuracy is not None for r in done if r.dataset == d) for d in datasets}
    headers = [f"{d} ({RULES[selected[d]]})" for d in datasets] if any(selected.values()) else datasets
    accuracy = ["| method | " + " | ".join(headers) + " |", "| --- " * (len(datasets) + 1) + "|"]
    simulated = any("simulated_seconds_per_round" in r.summary for r in done)
    costs = [
        "| method | data set | rounds | s/round | "
        + ("simulated s/round | " if simulated else "")
        + "params sent/round | n |",
        "| --- " * (6 + simulated) + "|",
    ]
    unseen = [
        "| method | data set | participating clients | unseen clients | participation gap | n |",
        "| --- " * 6 + "|",
    ]
    clients = [
        "| method | data set | final accuracy | worst 10 % of clients | largest 10 % of clients | n |",
        "| --- " * 6 + "|",
    ]
    for row in rows:
        cells = []
        for dataset in datasets:
            runs = [r for r in done if names[r.run_dir] == row and r.dataset == dataset]
            values = [r.selected_accuracy if selected[dataset] else r.best_accuracy for r in runs]
            cells.append(f"{mean_std(values)} (n={len(runs)})" if runs else "–")
            if runs:
                seconds = statistics.fmean(r.seconds_per_round for r in runs)
                params = statistics.fmean(r.params_sent_per_round for r in runs)
                rounds = "/".join(str(n) for n in dict.fromkeys(r.summary.get("rounds", "–") for r in runs))
                timed = [
                    r.summary["simulated_seconds_per_round"] for r in runs if "simulated_seconds_per_round" in r.summary
                ]
                sim = (f"{statistics.fmean(timed):,.2f} | " if timed else "– | ") if simulated else ""
                costs.append(f"| {row} | {dataset} | {rounds} | {seconds:,.2f} | {sim}{params:,.0f} | {len(runs)} |")
            held = [r for r in runs if r.at_rule("unseen_accuracy", selected[dataset]) is not None]
            if held:
                values = [
                    mean_std([r.selected_accuracy if selected[dataset] else r.best_accuracy for r in held]),
                    mean_std([r.at_rule("unseen_accuracy", selected[dataset]) for r in held]),
                    mean_std([r.at_rule("participation_gap", selected[dataset]) for r in held]),
                ]
                unseen.append(f"| {row} | {dataset} | " + " | ".join(values) + f" | {len(held)} |")
            final = [r for r in runs if r.final_largest10 is not None]
            if final:
                values = [mean_std([getattr(r, k) for r in final]) for k in FINAL_COLUMNS]
                clients.append(f"| {row} | {dataset} | " + " | ".join(values) + f" | {len(final)} |")
        accuracy.append(f"| {row} | " + " | ".join(cells) + " |")
    left_out = [f"- {r.run_dir}: {r.status}" + (f" ({r.note})" if r.note else "") for r in records if r not in done]
    note = ["", "Not completed, left out:", *left_out] if left_out else []
    rules = ["", RULES_NOTE] if any(selected.values()) else []
    tables = accuracy + rules + [""] + costs + ([""] + clients if len(clients) > 2 else [])
    tables += [""] + unseen if len(unseen) > 2 else []
    return "\n".join((tables if done else ["No completed run."]) + note)
