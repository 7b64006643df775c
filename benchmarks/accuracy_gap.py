"""Per-round test accuracy of two finished runs side by side, and the largest gap between them.

Usage: python benchmarks/accuracy_gap.py RUN_DIR_A RUN_DIR_B [--tolerance 0.3]

For two runs of one config and seed on different executors or devices, e.g. ``plfl fit --config
configs/fedala.yaml`` on the CPU with ``federation.executor=sequential`` and on a GPU with
``federation.executor=vectorized trainer.accelerator=gpu``: float rounding differs between them and
grows over the rounds, so their accuracies (the ``accuracy`` column of each run's metrics.csv, in %)
agree only to a tolerance. Prints a Markdown table (round, A, B, B − A in percentage points) and the
largest |B − A|; exits with status 1 when it exceeds ``--tolerance`` percentage points or the two
runs evaluated different rounds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from plfl.errors import PlflError
from plfl.report.runs import read_report_run


def accuracies(run_dir: Path) -> dict[int, float]:
    """Round → test accuracy (%) of the rounds the run evaluated, from ``run_dir/metrics.csv``.

    Raises:
        PlflError: ``run_dir`` is not a finished run directory, or its files cannot be read.
    """
    rounds, values = read_report_run(run_dir).series("accuracy")
    return {r: 100 * v for r, v in zip(rounds, values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs=2, type=Path, metavar="RUN_DIR")
    parser.add_argument("--tolerance", type=float, default=0.3, help="percentage points (default 0.3)")
    args = parser.parse_args()
    try:
        a, b = (accuracies(run) for run in args.runs)
    except PlflError as e:
        sys.exit(f"accuracy_gap.py: {e}")
    if not a or a.keys() != b.keys():
        sys.exit(f"the runs evaluated different rounds: {sorted(a)} and {sorted(b)}")
    print(f"A: {args.runs[0]}\nB: {args.runs[1]}\n")
    print("| round | A (%) | B (%) | B − A (pp) |\n| --- | --- | --- | --- |")
    for r in sorted(a):
        print(f"| {r} | {a[r]:.2f} | {b[r]:.2f} | {b[r] - a[r]:+.2f} |")
    worst = max(a, key=lambda r: abs(b[r] - a[r]))
    gap = abs(b[worst] - a[worst])
    print(f"\nlargest gap: {gap:.2f} pp (round {worst}); within {args.tolerance} pp: {gap <= args.tolerance}")
    sys.exit(0 if gap <= args.tolerance else 1)


if __name__ == "__main__":
    main()
