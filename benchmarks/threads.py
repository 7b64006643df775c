"""Seconds per round with plfl's default torch threads, one thread, and torch's default, on an idle machine and
beside a busy process.

Each run is ``plfl fit --config CONFIG federation.rounds=1`` in a fresh process (its seconds per round from
summary.json: round 1's training, aggregation and evaluation): plfl's default (``federation.threads`` null, no
``OMP_NUM_THREADS``), ``OMP_NUM_THREADS=1``, and ``federation.threads`` = torch's own default (the machine's
cores, what torch runs on when nobody sets it). "busy" runs them beside a second process that keeps one core busy
(a Python loop), as another job on a shared machine does. The script prints each setting's median seconds and
its ratio to the best setting of the same load.

    python benchmarks/threads.py [--config configs/fedavg.yaml] [--runs 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def torch_default_threads() -> int:
    """The intra-op threads torch starts with in a fresh process without OMP_NUM_THREADS."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env, capture_output=True, text=True
    )
    return int(out.stdout.strip())


def seconds_per_round(config: str, overrides: list[str], env: dict[str, str]) -> tuple[float, int]:
    """One round of ``config`` in a fresh ``plfl fit`` process: summary.json's seconds per round, and the torch
    threads it ran on (``federation.threads`` in its config.yaml)."""
    with tempfile.TemporaryDirectory() as out:
        code = "import sys; from plfl.cli import main; sys.exit(main(sys.argv[1:]))"
        args = ["fit", "--config", config, "federation.rounds=1", "progress_bar=false", "checkpoint_every=0"]
        args += [f"output_dir={out}", *overrides]
        done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"threads.py: plfl fit failed:\n{done.stderr[-3000:]}")
        (summary,) = Path(out).rglob("summary.json")
        threads = yaml.safe_load((summary.parent / "config.yaml").read_text())["federation"]["threads"]
        return json.loads(summary.read_text())["seconds_per_round"], threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/fedavg.yaml")
    parser.add_argument("--runs", type=int, default=2, help="runs of each setting and load (default 2)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cores = torch_default_threads()
    settings = {
        "plfl's default": (base, []),
        "OMP_NUM_THREADS=1": ({**base, "OMP_NUM_THREADS": "1"}, []),
        "torch's default": (base, [f"federation.threads={cores}"]),
    }
    print(f"{args.config} {' '.join(args.overrides)}: 1 round, {args.runs} runs each, {os.cpu_count()} CPUs")
    print("| load | setting | torch threads | median s/round | / best of this load |\n| --- | --- | --- | --- | --- |")
    for load in ("idle", "busy"):
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
        try:
            runs = {
                name: [seconds_per_round(args.config, args.overrides + extra, env) for _ in range(args.runs)]
                for name, (env, extra) in settings.items()
            }
        finally:
            if hog is not None:
                hog.kill()
        times = {name: statistics.median(seconds for seconds, _ in results) for name, results in runs.items()}
        best = min(times.values())
        for name, results in runs.items():
            threads = "/".join(str(t) for t in sorted({threads for _, threads in results}))
            print(
                f"| {load} | {name} | {threads} | {times[name]:.1f} | {times[name] / best:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
