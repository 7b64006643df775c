"""Cost of a per-round checkpoint for FedALA's reference federation (20 clients, 4-layer CNN on MNIST).

Usage: python benchmarks/checkpoint.py [--clients 20] [--repeats 5] [--dir /tmp/plfl-checkpoint-bench]

The state has the shape of FedALA's after a round: the global model, every
client's personalized model and ALA weights (p = 2), and 20 rounds of
results. Prints the file size and the best-of-N seconds to save (serialise,
hash, write, fsync, rename) and to read back (hash check, weights_only load).
"""

from __future__ import annotations

import argparse
import shutil
import timeit
from pathlib import Path

import torch

from plfl.checkpoint import read_checkpoint, save_checkpoint
from plfl.models import build_model
from plfl.seeding import global_rng_state


def fedala_like_state(num_clients: int) -> dict:
    model = build_model("cnn", (1, 28, 28), 10)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    top = list(params)[-2:]
    clients = [
        {
            "model": {k: v + i for k, v in params.items()},
            "ala_weights": {k: torch.rand_like(params[k]) for k in top},
            "ala_epochs": 1,
        }
        for i in range(num_clients)
    ]
    history = [
        {
            "round": r,
            "metrics": {"accuracy": 0.9, "seconds": 30.0},
            "tables": {},
            "clients": [{"round": r, "client": i, "accuracy": 0.9} for i in range(num_clients)],
        }
        for r in range(21)
    ]
    return {
        "format": 1,
        "round": 20,
        "history": history,
        "best": (0.98, 20),
        "failures": [],
        "method": {"global_params": params},
        "store": clients,
        "rng": global_rng_state(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/plfl-checkpoint-bench"))
    args = parser.parse_args()
    state = fedala_like_state(args.clients)
    path = save_checkpoint(args.dir, 20, state, keep=1)
    size = path.stat().st_size
    save = min(timeit.repeat(lambda: save_checkpoint(args.dir, 20, state, keep=1), number=1, repeat=args.repeats))
    load = min(timeit.repeat(lambda: read_checkpoint(path), number=1, repeat=args.repeats))
    shutil.rmtree(args.dir)
    print(
        f"checkpoint of {args.clients} clients: {size / 2**20:.1f} MiB; "
        f"save {save:.3f} s, read {load:.3f} s (best of {args.repeats})"
    )


if __name__ == "__main__":
    main()
