"""plfl's local training of one client-round vs a plain PyTorch loop over the same tensors.

Usage: python benchmarks/overhead.py [--data ../shared/data/fedala-mnist-dir0.1] [--client 0] [--repeats 3]

Both train the 4-layer CNN for one epoch with SGD (lr 0.005, batch 10) on the
client's training tensors, shuffled by the same seed; the script prints the
best-of-N seconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import timeit

import torch
import torch.nn.functional as F

from plfl.client import ClientModule, LocalTrainer, batch_loader, build_trainer
from plfl.config import DataConfig
from plfl.data import load_federated_data
from plfl.models import build_model


def plain_epoch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.005)
    model.train()
    for xb, yb in batch_loader(x, y, batch_size, seed):
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()


def best_of(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn``, in seconds."""
    return min(timeit.repeat(fn, number=1, repeat=repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/fedala-mnist-dir0.1")
    parser.add_argument("--client", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    data = load_federated_data(DataConfig(source="pfllib", root=args.data), seed=0)
    client = data.clients[args.client]
    model = build_model("cnn", data.input_shape, data.num_classes, [])
    params = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = LocalTrainer(ClientModule(model, data.num_classes, lr=0.005), build_trainer("cpu", 1, "32-true"),
                           args.batch_size)

    def plfl_round() -> None:
        trainer.train(params, client.x_train, client.y_train, seed=0, epochs=1)

    def plain_round() -> None:
        model.load_state_dict(params)
        plain_epoch(model, client.x_train, client.y_train, args.batch_size, seed=0)

    plfl_round()  # warm-up: the first fit sets the Trainer up
    plain, ours = best_of(plain_round, args.repeats), best_of(plfl_round, args.repeats)
    steps = -(-client.num_train // args.batch_size)
    print(f"client {args.client}: {client.num_train} samples, {steps} steps of batch {args.batch_size}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"plain PyTorch loop : {plain:.3f} s  ({1e3 * plain / steps:.3f} ms/step)")
    print(f"plfl LocalTrainer  : {ours:.3f} s  ({1e3 * ours / steps:.3f} ms/step)")
    print(f"ratio plfl / plain : {ours / plain:.2f}")


if __name__ == "__main__":
    main()
