"""Seconds per round of the sequential and the vectorized executor and of a plain PyTorch loop, in one run.

Usage: python benchmarks/round_time.py [--device cpu|cuda] [--method NAME] [--config FILE] [--rounds N]
       [--clients K] [--cohort-size C] [--no-cuda-graphs] [--kinds plain sequential vectorized] [--data DIR]
       [key=value ...]

Run from the repository root. The federation of ``configs/<method>.yaml``
(for fedavg and fedala: FedALA's MNIST, 4-layer CNN, batch 10, one local epoch), or of ``--config``
with the ``key=value`` overrides (e.g. ``configs/fedala-cifar10.yaml
model.name=resnet18 data.num_clients=100``), on its first K clients runs N
rounds with ``federation.executor=sequential`` and ``vectorized``,
evaluation (and the method's own steps, e.g. ALA) included. The plain loop trains the same clients one
after another with ``torch.optim.SGD`` on the same tensors (on the device) in the same batch
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

from plfl.batches import batch_loader
from plfl.callbacks import RunInfo
from plfl.client import use_precision
from plfl.client_side import LocalClients
from plfl.config import load_config
from plfl.data import load_federated_data
from plfl.executors import build_executor
from plfl.federation import FederationLoop
from plfl.methods import build_method, method_class
from plfl.methods.base import FederationContext
from plfl.models import models
from plfl.robust import weighted_average
from plfl.seeding import derive_seed
from plfl.state import ClientStateStore

ROOT = Path(__file__).resolve().parents[1]
KINDS = {
    "plain": "plain PyTorch loop (FedAvg training only)",
    "sequential": "plfl, federation.executor=sequential",
    "vectorized": "plfl, federation.executor=vectorized",
}


def seconds_per_round(kind: str, args: argparse.Namespace) -> list[float]:
    """Rounds 1..N of one kind; returns each round's seconds."""
    overrides = [*args.overrides, f"federation.rounds={args.rounds}"]
    if args.data:
        overrides.append(f"data.root={args.data}")
    if kind != "plain":
        overrides += [f"federation.executor={kind}", f"trainer.accelerator={'gpu' if args.device == 'cuda' else 'cpu'}"]
    if kind == "vectorized":
        overrides += [
            f"vectorized.cuda_graphs={str(args.cuda_graphs).lower()}",
            *([f"vectorized.cohort_size={args.cohort_size}"] if args.cohort_size else []),
        ]
    cfg = load_config(args.config or ROOT / "configs" / f"{args.method}.yaml", overrides)
    federation = OmegaConf.to_object(cfg.federation)
    L.seed_everything(federation.seed, verbose=False)
    data = load_federated_data(OmegaConf.to_object(cfg.data), federation.seed)
    data = dataclasses.replace(data, clients=data.clients[: args.clients])
    model = models()[cfg.model.name].of(cfg.model).build(data.input_shape, data.num_classes, data.vocab_size)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if kind == "plain":
        use_precision(cfg.trainer.precision)  # the float32 that build_trainer sets for plfl's kinds
        return plain_rounds(model.to(args.device), data, initial, federation, args.rounds, args.device)
    model = method_class(cfg.method.name).client_network(model)  # the method's own modules, e.g. GPFL's valve
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    config = OmegaConf.to_object(cfg)
    context = FederationContext(
        data, ClientStateStore(len(data.clients)), config.federation, model, config.data.augment
    )
    method = build_method(config.method, context, initial)
    executor = build_executor(config.work, config.executor_options, data, model)
    run = RunInfo(cfg, Path("."), len(data.clients), sum(p.numel() for p in model.parameters()))
    loop = FederationLoop(method, context, LocalClients(method, context.store, executor), [], run)
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
            for xb, yb in batch_loader(
                x, y, federation.batch_size, derive_seed(federation.seed, round_, i, "local_training")
            ):
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
    parser.add_argument("--method", default="fedavg", help="a method with a config in configs/<method>.yaml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=20, help="the first K clients of the federation")
    parser.add_argument("--config", type=Path, help="a config file instead of configs/<method>.yaml")
    parser.add_argument("--cohort-size", type=int, default=None, help="vectorized.cohort_size")
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vectorized.cuda_graphs",
    )
    parser.add_argument("--kinds", nargs="+", choices=tuple(KINDS), default=list(KINDS), help="what to time")
    parser.add_argument("--data", help="data.root (default: the config's)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every kind")
    parser.add_argument("--only", choices=tuple(KINDS), help=argparse.SUPPRESS)  # one kind, in this process
    args = parser.parse_args()
    if args.only:
        seconds = seconds_per_round(args.only, args)
        print(json.dumps({"seconds": seconds, "peak_mib": peak_memory_mib(args.device)}))
        return

    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, torch threads {torch.get_num_threads()}"
    print(
        f"{args.config or args.method} {' '.join(args.overrides)}, first {args.clients} clients, {args.rounds} "
        f"round(s), {device}, torch {torch.__version__}"
    )
    results = {}
    for kind in args.kinds:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", kind], capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"round_time.py: {kind} failed (exit status {out.returncode}):\n{out.stderr[-4000:]}")
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    mean = {kind: sum(r["seconds"]) / len(r["seconds"]) for kind, r in results.items()}
    base = mean.get("sequential")
    print("| what | s/round (rounds 1..N) | / sequential | peak memory (MiB) |")
    print("| --- | --- | --- | --- |")
    for kind in args.kinds:
        rounds = ", ".join(f"{s:.2f}" for s in results[kind]["seconds"])
        ratio = f"{mean[kind] / base:.2f}" if base else "–"
        print(f"| {KINDS[kind]} | {mean[kind]:.2f} ({rounds}) | {ratio} | {results[kind]['peak_mib']:.0f} |")


if __name__ == "__main__":
    main()
