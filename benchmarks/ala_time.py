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

from plfl.config import load_config
from plfl.data import load_federated_data
from plfl.executors import SequentialExecutor, VectorizedExecutor, drive
from plfl.executors.options import Vectorized
from plfl.methods.ala import local_aggregation, top_names
from plfl.methods.base import FederationContext
from plfl.models import models
from plfl.state import ClientStateStore

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "fedala-mnist-dir0.1"))
    args = parser.parse_args()
    cfg = load_config(ROOT / "configs" / "fedala.yaml", [f"data.root={args.data}"])
    run = OmegaConf.to_object(cfg)
    federation, config = run.federation, run.method
    data = load_federated_data(run.data, federation.seed)
    torch.manual_seed(federation.seed)
    model = models()[cfg.model.name].of(cfg.model).build(data.input_shape, data.num_classes, data.vocab_size)
    global_params = {k: v.clone() for k, v in model.state_dict().items()}
    local = [{k: v + 0.05 * torch.randn_like(v) for k, v in global_params.items()} for _ in data.clients]
    top = top_names(model, config.p)
    sequential = SequentialExecutor.of(run.work, data, model)
    executors = {
        "sequential": sequential,
        "vectorized": VectorizedExecutor(data, model, run.work, Vectorized(), torch.device(args.device), sequential),
    }
    print(
        f"ALA (s={config.s}, p={config.p}) on the {len(data.clients)} clients of {args.data}, {args.device}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print("| stage | executor | seconds | epochs in all |\n| --- | --- | --- | --- |")
    for stage, weights in (("initial", None), ("later", {k: torch.full_like(global_params[k], 0.5) for k in top})):
        for name, executor in executors.items():
            context = FederationContext(data, ClientStateStore(len(data.clients)), federation, model)
            for i in range(len(data.clients)):
                context.store.set(i, "ala_weights", weights)
            hooks = [local_aggregation(config, context, i, global_params, local[i], 1) for i in range(len(local))]
            start = time.perf_counter()
            drive(hooks, executor)  # every client's ALA, an epoch per request, as the federation loop runs it
            if args.device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            epochs = sum(context.store.get(i, "ala_epochs") for i in range(len(local)))
            print(f"| {stage} | {name} | {seconds:.2f} | {epochs} |", flush=True)


if __name__ == "__main__":
    main()
