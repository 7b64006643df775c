"""Seconds of ALA's weight learning alone (FedALA, Eq. 3–5), sequential vs vectorized executor.

Usage: python benchmarks/ala_time.py [--device cpu|cuda] [--data ../shared/data/fedala-mnist-dir0.1]

Every client of ``configs/fedala.yaml``'s federation learns its W_i from the
initial model (Θ) and a perturbed copy of it (Θ_i) twice: in the initial stage
(W_i absent: epochs until the loss settles) and as in a later round (W_i given:
one epoch). Prints seconds and the epochs run in all, which must agree.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from plfl.client import ClientModule, LocalTrainer, build_trainer
from plfl.config import load_config
from plfl.data import load_federated_data
from plfl.executors import LocalAggregationTask, SequentialExecutor, VectorizedExecutor
from plfl.methods.ala import top_names
from plfl.models import build_model

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "fedala-mnist-dir0.1"))
    args = parser.parse_args()
    cfg = load_config(ROOT / "configs" / "fedala.yaml", [f"data.root={args.data}"])
    federation, config = OmegaConf.to_object(cfg.federation), OmegaConf.to_object(cfg.method)
    data = load_federated_data(OmegaConf.to_object(cfg.data), federation.seed)
    torch.manual_seed(federation.seed)
    model = build_model(input_shape=data.input_shape, num_classes=data.num_classes,
                        **OmegaConf.to_container(cfg.model))
    trainer = LocalTrainer(ClientModule(model, data.num_classes, federation.lr), build_trainer(**cfg.trainer),
                           federation.batch_size)
    global_params = {k: v.clone() for k, v in model.state_dict().items()}
    local = [{k: v + 0.05 * torch.randn_like(v) for k, v in global_params.items()} for _ in data.clients]
    top = top_names(model, config.p)
    executors = {"sequential": SequentialExecutor(data, trainer),
                 "vectorized": VectorizedExecutor(data, trainer, torch.device(args.device), None, "32-true")}
    print(f"ALA (s={config.s}, p={config.p}) on the {len(data.clients)} clients of {args.data}, {args.device}, "
          f"torch threads {torch.get_num_threads()}")
    print("| stage | executor | seconds | epochs in all |\n| --- | --- | --- | --- |")
    for stage, weights in (("initial", None), ("later", {k: torch.full_like(global_params[k], 0.5) for k in top})):
        for name, executor in executors.items():
            tasks = [LocalAggregationTask(i, global_params, local[i], weights, i, config)
                     for i in range(len(data.clients))]
            start = time.perf_counter()
            outcomes = executor.aggregate_locally(tasks)
            if args.device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            print(f"| {stage} | {name} | {seconds:.2f} | {sum(o.epochs for o in outcomes)} |", flush=True)


if __name__ == "__main__":
    main()
