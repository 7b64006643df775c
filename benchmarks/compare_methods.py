"""Every method on one federation with the same settings; prints a Markdown table.

    python benchmarks/compare_methods.py [key=value ...] [--rounds 10] [--methods fedavg fedala ...]

Each method runs from its ``configs/<method>.yaml`` (data, model, method
keys) with the federation settings below overriding the config's, so all
methods share rounds, join ratio, local epochs, batch size, learning rate
and momentum. That changes some methods' own settings, and the table is
printed with each change (config value → common value): e.g. Self-FL's lr
0.03 → 0.005 makes Eq. 8 ask for several times more local steps, so its
l_max binds (metrics.csv: ``selffl_rule_steps_median``), and pFedLA's 10
epochs of batch 32 become 1 epoch of batch 10. A method whose run in ``--output-dir`` already reached
``--rounds`` is not run again; figures are read from its metrics.csv up to
``--rounds``: final and best accuracy (%), the global model's final accuracy
where the method has one, mean seconds per training round (rounds 1..R) and
megabytes sent/received per round. ``key=value`` overrides apply to every run
after the common settings (e.g. ``federation.executor=vectorized trainer.accelerator=gpu``).
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from plfl.methods import methods

# FedALA's reference setting (configs/fedala.yaml), shared by every method.
FEDERATION = {"join_ratio": 1.0, "batch_size": 10, "lr": 0.005, "momentum": 0.0, "seed": 0}
METHOD_KEYS = {"fedft": ["method.head_epochs=1"], "fedftha": ["method.head_epochs=1"], "heurpfedla": ["method.k=1"]}


def completed_run(run_root: Path, rounds: int) -> tuple[Path, list[dict[str, str]]] | None:
    """The latest run directory under ``run_root`` that got to round ``rounds``, with its rounds 0..rounds of
    metrics.csv, else None."""
    for run_dir in sorted(run_root.glob("*"), reverse=True):
        metrics = run_dir / "metrics.csv"
        rows = list(csv.DictReader(metrics.open())) if metrics.exists() else []
        if len(rows) > rounds:
            return run_dir, rows[: rounds + 1]
    return None


def completed_rows(run_root: Path, rounds: int) -> list[dict[str, str]] | None:
    """Rounds 0..rounds of the latest run under ``run_root`` that got that far, else None."""
    run = completed_run(run_root, rounds)
    return None if run is None else run[1]


def fit_cell(config_file: Path, name: str, output_dir: Path, rounds: int, keys: list[str]) -> Path:
    """The run directory of ``config_file`` run as ``name`` in ``output_dir`` for ``rounds`` rounds with the
    overrides ``keys``: a finished one found there (:func:`completed_run`); else the latest one there that saved
    a checkpoint, continued with ``plfl fit --resume`` (an interrupted benchmark picks up where it stopped); else
    a new run. Runs go in a subprocess of this interpreter.

    Raises:
        subprocess.CalledProcessError: the run failed.
    """
    if completed_run(output_dir / name, rounds) is None:
        command = [sys.executable, "-m", "plfl", "fit"]
        started = sorted(d for d in (output_dir / name).glob("*") if any((d / "checkpoints").glob("*.pt")))
        if started:
            command += ["--resume", str(started[-1])]
        else:
            command += ["--config", str(config_file), f"name={name}", f"output_dir={output_dir}", *keys]
        command += [f"federation.rounds={rounds}", "progress_bar=false"]
        print("$", " ".join(command), file=sys.stderr, flush=True)
        subprocess.run(command, check=True)
    return completed_run(output_dir / name, rounds)[0]


def departures(method: str) -> list[str]:
    """``key: config value → common value`` for every setting of FEDERATION and METHOD_KEYS that changes
    the method's own config."""
    from plfl.config import load_config

    cfg = load_config(Path(f"configs/{method}.yaml"))
    overrides = {f"federation.{k}": v for k, v in FEDERATION.items()}
    overrides.update(kv.split("=", 1) for kv in METHOD_KEYS.get(method, []))
    changed = []
    for key, value in overrides.items():
        own = OmegaConf.select(cfg, key)
        if str(own) != str(value) and float_or(own) != float_or(value):
            changed.append(f"{key}: {own} → {value}")
    return changed


def float_or(value: object) -> object:
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def table_row(method: str, rows: list[dict[str, str]]) -> str:
    def number(row: dict[str, str], key: str) -> float | None:
        return float(row[key]) if row.get(key) else None

    accuracy = [number(r, "accuracy") for r in rows]
    evaluated = [a for a in accuracy if a is not None]
    trained = rows[1:]

    def mean(key: str) -> float:
        return sum(number(r, key) or 0.0 for r in trained) / len(trained)

    global_accuracy = number(rows[-1], "global_accuracy")
    cells = [
        method,
        f"{100 * evaluated[-1]:.2f}",
        f"{100 * max(evaluated):.2f} (r{accuracy.index(max(evaluated))})",
        "–" if global_accuracy is None else f"{100 * global_accuracy:.2f}",
        f"{mean('seconds'):.1f}",
        f"{mean('bytes_sent') / 1e6:.1f}",
        f"{mean('bytes_received') / 1e6:.1f}",
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    names = list(methods())
    parser.add_argument("--methods", nargs="+", default=names, choices=names)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/compare"))
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")
    args = parser.parse_args()
    results = {}
    for method in args.methods:
        overrides = [f"federation.{k}={v}" for k, v in FEDERATION.items()] + METHOD_KEYS.get(method, [])
        fit_cell(Path(f"configs/{method}.yaml"), method, args.output_dir, args.rounds, overrides + args.overrides)
        results[method] = completed_rows(args.output_dir / method, args.rounds)
    print(f"Rounds: {args.rounds}; federation: {FEDERATION}; method keys: {METHOD_KEYS}; overrides: {args.overrides}")
    print(
        "| method | final acc. | best acc. (round) | global model acc. | s/round | MB sent/round | MB received/round |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for method, rows in results.items():
        print(table_row(method, rows))
    print("\nChanges to each method's own config (configs/<method>.yaml → the common setting):")
    for method in results:
        print(f"- {method}: {'; '.join(departures(method)) or 'none'}")


if __name__ == "__main__":
    main()
