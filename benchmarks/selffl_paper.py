"""Self-FL's experiments (Chen et al., NeurIPS 2022, Sec. 4.2) on its settings: Self-FL beside FedAvg, Ditto, pFedMe
and Per-FedAvg by round (Fig. 1a, 1b, 2a), Table 1's columns at the final round, and the ablation of Fig. 2b.

    python benchmarks/selffl_paper.py --setting mnist --seeds 0,1,2 --out runs/selffl-paper
    python benchmarks/selffl_paper.py --setting femnist --variants ablation --seeds 0,1,2 --out runs/selffl-paper

A setting is ``configs/selffl-<setting>.yaml``; each variant is one run per seed from it: a baseline is the method
switched (``method=fedavg``, its defaults, the config's federation with its fixed ``federation.local_steps``), an
ablation variant keeps one of Self-FL's three components and replaces the other two by FedAvg's. Runs finished
before (their summary.json completed) are reused, so an interrupted invocation continues where it stopped. Prints
the final round's mean ± std over seeds of the accuracy (sample-weighted, the papers' "weighted client-level test
accuracy"), the worst-10 % and largest-10 % accuracy (Table 1) and the global model's, and with ``--csv`` writes
every evaluated round's means and stds.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("accuracy", "global_accuracy", "worst10_accuracy", "largest10_accuracy")
BASELINES = {
    "selffl": [],
    "fedavg": ["method=fedavg"],
    "ditto": ["method=ditto"],
    "pfedme": ["method=pfedme"],
    "perfedavg": ["method=perfedavg"],
}
# Fig. 2b: each component of Self-FL alone, the other two FedAvg's (start from Θ^{t-1}, the fixed local steps,
# sample-size weights; all keep the smoothing by C).
ABLATION = {
    "selffl": [],
    "selffl-init-only": ["method.steps=fixed", "method.aggregation=samples"],
    "selffl-steps-only": ["method.init=global", "method.aggregation=samples"],
    "selffl-aggregation-only": ["method.init=global", "method.steps=fixed"],
}
VARIANTS = {"baselines": BASELINES, "ablation": ABLATION}


def run_dir(out: Path, name: str) -> Path | None:
    """The newest completed run named ``name`` under ``out``, or None."""
    for candidate in sorted((out / name).glob("*/summary.json"), reverse=True):
        if json.loads(candidate.read_text()).get("status") == "completed":
            return candidate.parent
    return None


def fit(config: Path, out: Path, name: str, overrides: list[str]) -> Path:
    """The completed run ``name``: reused, or run now (its output in ``<out>/<name>.log``)."""
    done = run_dir(out, name)
    if done is not None:
        return done
    command = [sys.executable, "-m", "plfl", "fit", "--config", str(config), f"output_dir={out}", f"name={name}"]
    command += ["progress_bar=false", *overrides]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    done = run_dir(out, name)
    if code or done is None:
        raise SystemExit(f"{name} failed (exit {code}); see {out / f'{name}.log'}")
    return done


def rounds_of(run: Path) -> dict[int, dict[str, float]]:
    """Evaluated round → its metrics (fractions) from metrics.csv."""
    with open(run / "metrics.csv") as f:
        return {
            int(row["round"]): {k: float(row[k]) for k in METRICS if row.get(k)}
            for row in csv.DictReader(f)
            if row.get("accuracy")
        }


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std in %."""
    return 100 * statistics.fmean(values), 100 * statistics.pstdev(values)


def round_table(setting: str, by_variant: dict[str, list[dict[int, dict[str, float]]]]) -> list[dict]:
    """One row per variant and round that every seed's run evaluated: ``<metric>`` and ``<metric>_std``, the mean
    and population std over the seeds in %, rounded to 2 decimals, for each of :data:`METRICS` all runs hold.
    ``by_variant``: variant → one :func:`rounds_of` per seed."""
    rows = []
    for variant, seeds_rounds in by_variant.items():
        for round_ in sorted(set.intersection(*(set(r) for r in seeds_rounds))):
            row = {"setting": setting, "method": variant, "round": round_, "seeds": len(seeds_rounds)}
            for key in METRICS:
                values = [r[round_][key] for r in seeds_rounds if key in r[round_]]
                if len(values) == len(seeds_rounds):
                    row[key], row[f"{key}_std"] = (round(v, 2) for v in mean_std(values))
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", required=True, help="configs/selffl-<setting>.yaml: mnist, femnist, ...")
    parser.add_argument("--variants", choices=VARIANTS, default="baselines")
    parser.add_argument("--only", default=None, help="comma-separated variants of --variants to run (default all)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated federation.seed values")
    parser.add_argument("--out", type=Path, default=Path("runs/selffl-paper"), help="where the runs go")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--csv", type=Path, default=None, help="write every evaluated round's means and stds here")
    parser.add_argument("overrides", nargs="*", help="key=value for every run, e.g. federation.rounds=20")
    args = parser.parse_args()
    config = ROOT / "configs" / f"selffl-{args.setting}.yaml"
    if not config.is_file():
        settings = ", ".join(sorted(p.stem.removeprefix("selffl-") for p in config.parent.glob("selffl-*.yaml")))
        raise SystemExit(f"{config} does not exist; settings: {settings}")
    variants = VARIANTS[args.variants]
    if args.only:
        variants = {k: variants[k] for k in args.only.split(",")}
    seeds = [int(s) for s in args.seeds.split(",")]
    out = args.out.resolve() / args.setting
    jobs = [
        (variant, seed, f"{variant}-seed{seed}", [*overrides, f"federation.seed={seed}", *args.overrides])
        for variant, overrides in variants.items()
        for seed in seeds
    ]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda job: fit(config, out, job[2], job[3]), jobs))
    by_variant: dict[str, list[dict[int, dict[str, float]]]] = {}
    for (variant, *_), run in zip(jobs, runs):
        by_variant.setdefault(variant, []).append(rounds_of(run))

    rows = round_table(args.setting, by_variant)
    print(f"{args.setting}, final round, mean ± std over seeds {args.seeds} (%):")
    print("| method | accuracy | worst 10 % | largest 10 % | global model |\n| --- | --- | --- | --- | --- |")
    for variant in by_variant:
        last = [r for r in rows if r["method"] == variant][-1]
        cells = [f"{last[k]:.2f} ± {last[k + '_std']:.2f}" if k in last else "–" for k in METRICS]
        print(f"| {variant} (round {last['round']}) | {cells[0]} | {cells[2]} | {cells[3]} | {cells[1]} |")
    if args.csv:
        columns = list(dict.fromkeys(k for row in rows for k in row))
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
