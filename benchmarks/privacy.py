"""Accuracy against sample-level differential privacy; prints a Markdown table, writes privacy.csv.

    python benchmarks/privacy.py [key=value ...] [--methods fedavg fedala ditto] [--epsilons 1 3 8 inf]
        [--delta 1e-5] [--rounds 20] [--output-dir runs/privacy]

Each cell is one run of ``configs/<method>.yaml`` for ``--rounds`` rounds with DP-SGD in every client's local
steps (``privacy.level=sample``) and σ computed for ``privacy.target_epsilon`` ε at ``privacy.delta`` δ, so that
a client training in every round reaches ε after the last; ``inf`` is the run without DP. ``key=value``
overrides apply to every run (DP-SGD wants larger batches and learning rates than the configs' batch 10 and
lr 0.005, e.g. ``federation.batch_size=64 federation.lr=0.1``). A run in ``--output-dir`` that already reached
``--rounds`` is not run again. Figures: the final round's accuracy (%), the largest ε a client reached
(``epsilon_max``) and σ.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

from compare_methods import completed_rows, fit_cell

ROOT = Path(__file__).resolve().parents[1]


def cell_overrides(epsilon: float, delta: float) -> list[str]:
    """The keys of one cell: DP-SGD for the target ``epsilon`` at ``delta``, or no DP when ``epsilon`` is inf."""
    if math.isinf(epsilon):
        return ["privacy.level=none"]
    return ["privacy.level=sample", f"privacy.target_epsilon={epsilon:g}", f"privacy.delta={delta:g}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["fedavg", "fedala", "ditto"])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 3.0, 8.0, math.inf])
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/privacy"))
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")
    args = parser.parse_args()
    rows = []
    for method in args.methods:
        for epsilon in args.epsilons:
            name = f"{method}-epsilon-{epsilon:g}"
            keys = [*args.overrides, *cell_overrides(epsilon, args.delta)]
            run_dir = fit_cell(ROOT / "configs" / f"{method}.yaml", name, args.output_dir, args.rounds, keys)
            last = completed_rows(args.output_dir / name, args.rounds)[-1]
            summary = json.loads((run_dir / "summary.json").read_text())
            rows.append(
                {
                    "method": method,
                    "target_epsilon": f"{epsilon:g}",
                    "accuracy": f"{100 * float(last['accuracy']):.2f}",
                    "epsilon": f"{float(last['epsilon_max']):.3f}" if last.get("epsilon_max") else "inf",
                    "noise_multiplier": f"{summary['noise_multiplier']:.4f}" if "noise_multiplier" in summary else "0",
                }
            )
    with (args.output_dir / "privacy.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{args.rounds} rounds, δ {args.delta:g}; overrides: {args.overrides}. Final accuracy (%), ε reached, σ.")
    print("| method | " + " | ".join(f"ε = {e:g}" for e in args.epsilons) + " |")
    print("| --- | " + " | ".join("---" for _ in args.epsilons) + " |")
    for method in args.methods:
        cells = [r for r in rows if r["method"] == method]
        text = [f"{r['accuracy']} (ε {r['epsilon']}, σ {r['noise_multiplier']})" for r in cells]
        print(f"| {method} | " + " | ".join(text) + " |")


if __name__ == "__main__":
    main()
