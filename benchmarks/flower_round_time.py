"""Seconds per round of a config run as a Flower app beside the sequential executor; prints a table, writes
flower-round-time.csv.

    python benchmarks/flower_round_time.py [--config configs/quickstart.yaml] [--nodes 4] [--rounds 5]
        [--timeout 120] [--output-dir runs/flower-round-time] [key=value ...]

Three runs of the config with the same seed (``key=value`` overrides apply to each; the default adds
``method=fedavg``): the sequential executor (``plfl fit``); Flower's simulation runtime (``plfl flower run``: Ray,
one CPU per SuperNode); and a loopback deployment (:class:`plfl.flower.loopback.LoopbackDeployment`: a SuperLink with
TLS and SuperNode authentication and ``--nodes`` SuperNodes as processes, each reading only the files ``plfl flower
split`` wrote for it, the app run with ``flwr run``). Figures: seconds per round, the mean over rounds 1..R of each
run's summary, and the final accuracy (%), the same for the three runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from plfl.config import load_config
from plfl.data import load_federated_data
from plfl.flower.app import write_app
from plfl.flower.loopback import LoopbackDeployment
from plfl.flower.node_data import write_node_data

ROOT = Path(__file__).resolve().parents[1]


def summary(runs: Path, name: str) -> dict:
    """The summary of the one run named ``name`` under ``runs``."""
    (run_dir,) = (runs / name).iterdir()
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the nodes' replies")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/flower-round-time"))
    parser.add_argument("overrides", nargs="*", metavar="key=value", default=["method=fedavg"])
    args = parser.parse_args()
    output = args.output_dir.resolve()
    shutil.rmtree(output, ignore_errors=True)
    runs = output / "runs"
    common = [*args.overrides, f"federation.rounds={args.rounds}", f"output_dir={runs}", "progress_bar=false"]
    plfl = [sys.executable, "-m", "plfl"]
    subprocess.run([*plfl, "fit", "--config", str(args.config), *common, "name=sequential"], check=True)
    simulation = ["flower", "run", "--config", str(args.config), "--nodes", str(args.nodes), *common]
    subprocess.run([*plfl, *simulation, "name=simulation"], check=True)
    cfg = load_config(args.config, common)
    data = load_federated_data(OmegaConf.to_object(cfg).data, cfg.federation.seed)
    nodes = write_node_data(data, args.nodes, output / "data")
    app = output / "app"
    write_app(app, args.config, args.nodes, args.timeout, [*common, "name=deployment"])
    with LoopbackDeployment(output / "deployment", args.nodes) as deployment:
        for k, directory in enumerate(nodes):
            deployment.start_node(k, {"data-dir": str(directory)})
        deployment.run(app)
    rows = []
    for kind in ("sequential", "simulation", "deployment"):
        done = summary(runs, kind)
        if done["status"] != "completed":
            raise SystemExit(f"the {kind} run did not complete: {done.get('error')}")
        rows.append(
            {
                "run": kind,
                "nodes": "" if kind == "sequential" else args.nodes,
                "rounds": done["rounds"],
                "seconds_per_round": f"{done['seconds_per_round']:.2f}",
                "final_accuracy": f"{100 * done['final_accuracy']:.2f}",
            }
        )
    with (output / "flower-round-time.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{args.config.name} {' '.join(args.overrides)}, {args.rounds} rounds")
    print("| run | nodes | seconds per round | final accuracy (%) |\n| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['run']} | {row['nodes']} | {row['seconds_per_round']} | {row['final_accuracy']} |")


if __name__ == "__main__":
    main()
