"""Accuracy under poisoned clients with each aggregation rule; prints a Markdown table, writes robustness.csv.

    python benchmarks/robustness.py [key=value ...] [--methods fedavg fedala] [--attacks sign_flip ...]
        [--rules mean median ...] [--fraction 0.2] [--rounds 20] [--output-dir runs/robustness]

Each cell is one run of ``configs/<method>.yaml`` for ``--rounds`` rounds with ``attack.kind``,
``attack.fraction`` and ``aggregation.rule`` set; ``none`` among ``--attacks`` is the clean run (no malicious
clients). The attacks' and rules' own keys follow the malicious share f = ``--fraction``: sign flipping and
scaling send λ = ``--scale`` times the update (reversed for sign flipping), Gaussian noise has σ =
``--noise-std``; the trimmed mean drops the share f at each end, Krum and Multi-Krum assume the malicious clients'
count (round(f · N)) Byzantine and Multi-Krum averages the N − f best (Blanchard et al.'s m = n − f); norm bounding
clips updates to ``--max-norm``. ``key=value`` overrides apply to every run. A run in ``--output-dir`` that already
reached ``--rounds`` is not run again. Figures: the final round's accuracy (%) and, for the backdoor, the share of
triggered test images classified as the target (%).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from compare_methods import completed_rows, fit_cell

from plfl.config import load_config
from plfl.data.loading import load_federated_data
from plfl.seeding import clients_per_round

ROOT = Path(__file__).resolve().parents[1]
ATTACKS = ("none", "label_flip", "sign_flip", "scale", "gaussian", "backdoor")
RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "norm_bound")


def cell_overrides(attack: str, rule: str, args: argparse.Namespace, sampled: int, malicious: int) -> list[str]:
    """The keys of one cell: the attack with its own keys, the rule with its own (``sampled`` clients a round,
    ``malicious`` of them Byzantine)."""
    keys = [f"aggregation.rule={rule}"]
    if attack != "none":
        keys += [f"attack.kind={attack}", f"attack.fraction={args.fraction}"]
    if attack in ("sign_flip", "scale"):
        keys.append(f"attack.scale={args.scale}")
    if attack == "gaussian":
        keys.append(f"attack.noise_std={args.noise_std}")
    if rule == "trimmed_mean":
        keys.append(f"aggregation.trim={args.fraction}")
    if rule in ("krum", "multi_krum"):
        keys.append(f"aggregation.byzantine={malicious}")
    if rule == "multi_krum":
        keys.append(f"aggregation.selected={sampled - malicious}")
    if rule == "norm_bound":
        keys.append(f"aggregation.max_norm={args.max_norm}")
    return keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["fedavg", "fedala"])
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    parser.add_argument("--fraction", type=float, default=0.2, help="the malicious share of the clients")
    parser.add_argument("--scale", type=float, default=4.0, help="sign_flip and scale: λ")
    parser.add_argument("--noise-std", type=float, default=1.0, help="gaussian: σ")
    parser.add_argument("--max-norm", type=float, default=1.0, help="norm_bound: M")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/robustness"))
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")
    args = parser.parse_args()
    rows = []
    for method in args.methods:
        config_file = ROOT / "configs" / f"{method}.yaml"
        config = load_config(config_file, args.overrides)
        num_clients = len(load_federated_data(config.data, config.federation.seed).clients)
        sampled = clients_per_round(num_clients, config.federation.join_ratio)
        malicious = max(1, round(args.fraction * num_clients))
        for attack in args.attacks:
            for rule in args.rules:
                name = f"{method}-{attack}-{rule}"
                keys = cell_overrides(attack, rule, args, sampled, malicious)
                fit_cell(config_file, name, args.output_dir, args.rounds, [*args.overrides, *keys])
                last = completed_rows(args.output_dir / name, args.rounds)[-1]
                backdoor = last.get("backdoor_success")
                rows.append(
                    {
                        "method": method,
                        "attack": attack,
                        "rule": rule,
                        "accuracy": f"{100 * float(last['accuracy']):.2f}",
                        "backdoor_success": f"{100 * float(backdoor):.2f}" if backdoor else "",
                    }
                )
    with (args.output_dir / "robustness.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(
        f"{args.rounds} rounds, malicious share {args.fraction}, λ {args.scale}, σ {args.noise_std}, "
        f"M {args.max_norm}; overrides: {args.overrides}. Final accuracy (%), backdoor success in brackets."
    )
    print("| method | attack | " + " | ".join(args.rules) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in args.rules) + " |")
    for method in args.methods:
        for attack in args.attacks:
            cells = [r for r in rows if r["method"] == method and r["attack"] == attack]
            text = [r["accuracy"] + (f" ({r['backdoor_success']})" if r["backdoor_success"] else "") for r in cells]
            print(f"| {method} | {attack} | " + " | ".join(text) + " |")


if __name__ == "__main__":
    main()
