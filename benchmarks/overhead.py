"""plfl's local training of one client-round vs a plain PyTorch loop over the same tensors.

Usage: python benchmarks/overhead.py [--data ../shared/data/fedala-mnist-dir0.1] [--client 0] [--repeats 3]

Both train the same 4-layer CNN object (so both channels_last: ClientModule converts it) for one
epoch with SGD (lr 0.005, batch 10) from the same parameters, in the same batch order: the plain
loop draws plfl's permutation for local epoch 0 (``epoch_order``: one ``torch.randperm``) and
indexes the tensors with slices of it, the cheapest way to shuffle; the script checks that both end
with identical parameters. plfl's time also covers what a client-round needs beyond the loop:
loading the start parameters (both do), reading the trained ones back, and the mean loss.

The two alternate, ``--repeats`` times each, so that other processes on a shared machine slow
both alike. Printed: the best wall-clock and CPU (process) time of each, their ratios, and the
median of the per-pair CPU ratios; CPU time leaves out the time spent waiting for a core, and the
median pair the runs that others slowed, the steadier figures on a busy machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from plfl.batches import epoch_order
from plfl.client import ClientModule, LocalTrainer, build_trainer
from plfl.config import DataConfig
from plfl.data import load_federated_data
from plfl.models import build_model


def plain_epoch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.005)
    model.train()
    for index in epoch_order(len(y), seed, 0).split(batch_size):
        optimizer.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        optimizer.step()


def timed(fn) -> tuple[float, float]:
    """Wall-clock and CPU seconds of one call of ``fn``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/fedala-mnist-dir0.1")
    parser.add_argument("--client", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    data = load_federated_data(DataConfig(source="pfllib", root=args.data), seed=0)
    client = data.clients[args.client]
    model = build_model("cnn", data.input_shape, data.num_classes)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = LocalTrainer(
        ClientModule(model, data.num_classes, lr=0.005), build_trainer("cpu", 1, "32-true"), args.batch_size
    )

    def plfl_round() -> dict[str, torch.Tensor]:
        return trainer.train(params, client.x_train, client.y_train, seed=0, epochs=1).params

    def plain_round() -> None:
        model.load_state_dict(params)
        plain_epoch(model, client.x_train, client.y_train, args.batch_size, seed=0)

    trained = plfl_round()  # also the warm-up: the first fit sets the Trainer up
    plain_round()
    identical = all(torch.equal(trained[k], v) for k, v in model.state_dict().items())
    times = {"plain": [], "plfl": []}
    for _ in range(args.repeats):
        times["plain"].append(timed(plain_round))
        times["plfl"].append(timed(plfl_round))
    (plain_wall, plain_cpu), (ours_wall, ours_cpu) = (
        [min(t[i] for t in times[side]) for i in (0, 1)] for side in ("plain", "plfl")
    )
    steps = -(-client.num_train // args.batch_size)
    print(
        f"client {args.client}: {client.num_train} samples, {steps} steps of batch {args.batch_size}, "
        f"torch threads {torch.get_num_threads()}, best of {args.repeats}; identical parameters: {identical}"
    )
    for name, wall, cpu in (("plain PyTorch loop", plain_wall, plain_cpu), ("plfl LocalTrainer ", ours_wall, ours_cpu)):
        print(f"{name} : {wall:.3f} s wall, {cpu:.3f} s CPU ({1e3 * cpu / steps:.3f} ms/step)")
    pairs = statistics.median(ours[1] / plain[1] for plain, ours in zip(times["plain"], times["plfl"]))
    print(
        f"ratio plfl / plain : {ours_wall / plain_wall:.3f} wall, {ours_cpu / plain_cpu:.3f} CPU; "
        f"median pair {pairs:.3f} CPU"
    )


if __name__ == "__main__":
    main()
