"""kNN-Per's accuracy against the datastore's capacity and the interpolation weight λ, on one global model.

Usage: python benchmarks/knnper_memory.py RUN_DIR [--capacities 0.01 0.05 ...] [--weights 0 0.5 1]

For a kNN-Per run (``method.name=knnper``), reads the newest checkpoint's global model (FedAvg's, after the
checkpoint's round) and, for each capacity c (the fraction of every client's training samples kept in its datastore,
``method.capacity``), builds every client's datastore as the run's broadcast does (``KNNPer.pre_local_init``) and
evaluates every client's test split with the interpolated prediction (Eq. 7) at each λ. Prints a table of test
accuracy pooled over all clients (%), as the run's ``accuracy`` is: one row per capacity, one column per λ; λ = 0
is the global model alone, the same at every capacity, and λ = 1 the kNN model alone. The paper's figures of
accuracy against capacity and against λ (Marfoq et al., ICML 2022, Sec. 5) read off its rows and columns.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from plfl.checkpoint import load_latest_checkpoint
from plfl.config import resume_config
from plfl.cpus import use_torch_threads
from plfl.data.loading import load_federated_data
from plfl.errors import PlflError
from plfl.executors import build_executor, drive
from plfl.methods.base import FederationContext
from plfl.methods.knnper import WEIGHT, KNNPer
from plfl.models import models
from plfl.state import ClientStateStore
from plfl.tasks import EvalTask


def accuracy_table(run_dir: Path, capacities: list[float], weights: list[float]) -> tuple[int, dict]:
    """(the checkpoint's round, {capacity: {λ: pooled test accuracy in [0, 1]}}) of the run in ``run_dir``.

    Raises:
        PlflError: not a kNN-Per run, or no checkpoint.
    """
    if not all(0 < c <= 1 for c in capacities) or not all(0 <= w <= 1 for w in weights):
        raise PlflError(f"capacities must lie in (0, 1] and weights in [0, 1]; got {capacities} and {weights}.")
    cfg = resume_config(run_dir)
    if cfg.method.name != "knnper":
        raise PlflError(f"{run_dir} is a {cfg.method.name} run; this reads kNN-Per runs.")
    _, state = load_latest_checkpoint(run_dir / "checkpoints")
    config = OmegaConf.to_object(cfg)
    use_torch_threads(config.federation.threads)
    data = load_federated_data(config.data, config.federation.seed)
    model = models()[config.model.name].of(config.model).build(data.input_shape, data.num_classes, data.vocab_size)
    executor = build_executor(config.work, config.executor_options, data, model)
    table: dict[float, dict[float, float]] = {}
    try:
        for capacity in capacities:
            context = FederationContext(data, ClientStateStore(len(data.clients)), config.federation, model)
            method_config = dataclasses.replace(config.method, capacity=capacity, weight_grid=[])
            method = KNNPer(method_config, context, state["method"]["global_params"])
            method.load_state_dict(state["method"])
            clients = range(len(data.clients))
            built = drive([method.pre_local_init(i, method.global_params, state["round"]) for i in clients], executor)
            tasks = [
                EvalTask(i, {**m, WEIGHT: torch.tensor(float(w))}, forward=method.prediction())
                for w in weights
                for i, m in zip(clients, built)
            ]
            results = executor.evaluate(tasks)
            n = len(data.clients)
            table[capacity] = {
                w: sum(r.correct for r in results[j * n : (j + 1) * n])
                / sum(r.total for r in results[j * n : (j + 1) * n])
                for j, w in enumerate(weights)
            }
    finally:
        executor.close()
    return state["round"], table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--capacities", type=float, nargs="+", default=[0.01, 0.05, 0.2, 0.5, 1.0])
    parser.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    args = parser.parse_args()
    try:
        round_, table = accuracy_table(args.run_dir, args.capacities, args.weights)
    except PlflError as e:
        sys.exit(f"knnper_memory.py: {e}")
    print(f"{args.run_dir}: the global model after round {round_}; test accuracy (%), pooled over the clients")
    print("capacity | " + " | ".join(f"λ={w:g}" for w in args.weights))
    for capacity, row in table.items():
        print(f"{capacity:g} | " + " | ".join(f"{100 * row[w]:.2f}" for w in args.weights))


if __name__ == "__main__":
    main()
