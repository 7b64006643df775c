"""Seconds per round of the sequential and the vectorized executor and of a plain PyTorch loop, in one run.

Usage: python benchmarks/round_time.py [--device cpu|cuda] [--method fedavg|fedala] [--rounds N] [--clients K]
       [--cohort-size C] [--data ../shared/data/fedala-mnist-dir0.1]

The federation of ``configs/<method>.yaml`` (FedALA's MNIST: 4-layer CNN,
batch 10, one local epoch) on its first K clients runs N rounds with
``federation.executor=sequential`` and ``vectorized``, evaluation (and ALA)
included. The plain loop trains the same clients one after another with
``torch.optim.SGD`` on the same tensors (on the device) in the same batch
order and averages them: FedAvg's training and aggregation only. Each runs in
a process of its own, so that its peak memory (``ru_maxrss`` on the CPU,
``torch.cuda.max_memory_allocated`` on CUDA) is its own. Seconds per round:
the mean over rounds 1..N (round 0 only evaluates).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from plfl.callbacks import RunInfo
from plfl.client import ClientModule, LocalTrainer, batch_loader, build_trainer
from plfl.config import load_config
from plfl.data import load_federated_data
from plfl.executors import build_executor
from plfl.federation import FederationLoop
from plfl.methods import method_class
from plfl.methods.base import FederationContext
from plfl.methods.fedavg import weighted_average
from plfl.models import build_model
from plfl.seeding import LOCAL_TRAINING, derive_seed
from plfl.state import ClientStateStore

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"plain": "plain PyTorch loop (FedAvg training only)", "sequential": "plfl, federation.executor=sequential",
         "vectorized": "plfl, federation.executor=vectorized"}


def seconds_per_round(kind: str, args: argparse.Namespace) -> list[float]:
    """Rounds 1..N of one kind; returns each round's seconds."""
    overrides = [f"data.root={args.data}", f"federation.rounds={args.rounds}", f"federation.executor={kind}",
                 f"trainer.accelerator={'gpu' if args.device == 'cuda' else 'cpu'}"]
    if kind == "vectorized" and args.cohort_size:
        overrides.append(f"federation.cohort_size={args.cohort_size}")
    cfg = load_config(ROOT / "configs" / f"{args.method}.yaml", overrides if kind != "plain" else overrides[:2])
    federation = OmegaConf.to_object(cfg.federation)
    L.seed_everything(federation.seed, verbose=False)
    data = load_federated_data(OmegaConf.to_object(cfg.data), federation.seed)
    data = dataclasses.replace(data, clients=data.clients[:args.clients])
    model = build_model(input_shape=data.input_shape, num_classes=data.num_classes, **OmegaConf.to_container(cfg.model))
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if kind == "plain":
        return plain_rounds(model.to(args.device), data, initial, federation, args.rounds, args.device)
    trainer = LocalTrainer(ClientModule(model, data.num_classes, federation.lr, federation.momentum),
                           build_trainer(**cfg.trainer), federation.batch_size)
    context = FederationContext(data, ClientStateStore(len(data.clients)), model, trainer, federation)
    method = method_class(cfg.method.name)(OmegaConf.to_object(cfg.method), context, initial)
    executor = build_executor(federation, data, trainer, cfg.trainer.accelerator, cfg.trainer.precision)
    run = RunInfo(cfg, Path("."), len(data.clients), sum(p.numel() for p in model.parameters()))
    loop = FederationLoop(method, context, [], run, executor)
    loop.run()
    return [r.metrics["seconds"] for r in loop.history if r.round > 0]


def plain_rounds(model, data, params, federation, rounds: int, device: str) -> list[float]:
    """FedAvg's rounds as a plain loop: every client one epoch of SGD from the global model, then the average."""
    tensors = [(c.x_train.to(device), c.y_train.to(device)) for c in data.clients]
    seconds = []
    for round_ in range(1, rounds + 1):
        start = time.perf_counter()
        states = []
        for i, (x, y) in enumerate(tensors):
            model.load_state_dict(params)
            optimizer = torch.optim.SGD(model.parameters(), lr=federation.lr, momentum=federation.momentum)
            for xb, yb in batch_loader(x, y, federation.batch_size, derive_seed(federation.seed, round_, i,
                                                                               LOCAL_TRAINING)):
                optimizer.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                optimizer.step()
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        params = weighted_average(states, [len(y) for _, y in tensors])
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def peak_memory_mib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--method", choices=("fedavg", "fedala"), default="fedavg")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=20, help="the first K clients of the federation")
    parser.add_argument("--cohort-size", type=int, default=None, help="federation.cohort_size of vectorized")
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "fedala-mnist-dir0.1"))
    parser.add_argument("--only", choices=tuple(KINDS), help=argparse.SUPPRESS)  # one kind, in this process
    args = parser.parse_args()
    if args.only:
        seconds = seconds_per_round(args.only, args)
        print(json.dumps({"seconds": seconds, "peak_mib": peak_memory_mib(args.device)}))
        return

    print(f"{args.method}, first {args.clients} clients of {args.data}, {args.rounds} round(s), {args.device}, "
          f"torch threads {torch.get_num_threads()}")
    results = {}
    for kind in KINDS:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", kind], capture_output=True,
                             text=True, check=True)
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    mean = {kind: sum(r["seconds"]) / len(r["seconds"]) for kind, r in results.items()}
    print("| what | s/round (rounds 1..N) | / sequential | peak memory (MiB) |")
    print("| --- | --- | --- | --- |")
    for kind, label in KINDS.items():
        rounds = ", ".join(f"{s:.2f}" for s in results[kind]["seconds"])
        print(f"| {label} | {mean[kind]:.2f} ({rounds}) | {mean[kind] / mean['sequential']:.2f} | "
              f"{results[kind]['peak_mib']:.0f} |")


if __name__ == "__main__":
    main()
