"""FedBN's evaluated models with each client's own BatchNorm layers, re-estimated statistics and shared γ, β.

Usage: python benchmarks/fedbn_statistics.py RUN_DIR [--round R]

For a FedBN run (``method.name=fedbn``) with a checkpoint (``checkpoint_every`` > 0; a completed run keeps
its last, ``keep_checkpoints`` more), reads round R's checkpoint (default: the newest) and evaluates every
client's test split with three models:

- ``evaluated``: the averaged weights under the client's own BatchNorm layers, what FedBN evaluates
  (Alg. 1) and reports as round r's ``accuracy``;
- ``re-estimated``: the same, with the BatchNorm running mean and variance recomputed on the client's
  training split under the averaged weights (a forward pass, no step);
- ``shared γ, β``: as ``re-estimated``, with the BatchNorm layers' γ and β replaced by their mean over
  the clients (weighted by training samples), as FedAvg would have them.

Prints each as accuracy pooled over all test samples (%), as ``accuracy`` is, beside the run's own
``accuracy`` of round R (which ``evaluated`` reproduces). What ``re-estimated`` gains over ``evaluated``
is due to the statistics a client kept from its own weights; what ``shared γ, β`` gains over
``re-estimated``, to the client's own γ and β under the averaged weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from plfl.checkpoint import checkpoint_path, list_checkpoints, load_latest_checkpoint, read_checkpoint
from plfl.config import resume_config
from plfl.data.loading import load_federated_data
from plfl.errors import PlflError
from plfl.models import models
from plfl.report.runs import read_report_run

BATCH = 500  # samples per forward pass; re-estimation averages over all batches (momentum None)


def correct(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Test samples of (x, y) that ``model`` in eval mode classifies correctly."""
    model.eval()
    with torch.no_grad():
        return sum(int((model(xb).argmax(1) == yb).sum()) for xb, yb in zip(x.split(BATCH), y.split(BATCH)))


def reestimate(model: nn.Module, x: torch.Tensor) -> None:
    """Recompute every BatchNorm layer's running mean and variance on x (cumulative average, no step)."""
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None
    model.train()
    with torch.no_grad():
        for xb in x.split(BATCH):
            model(xb)


def shared_affine(model: nn.Module, store: list[dict], samples: list[int]) -> dict[str, torch.Tensor]:
    """The BatchNorm layers' γ and β (``weight``, ``bias``) averaged over the clients' models, by samples."""
    keys = [
        f"{name}.{p}"
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for p in ("weight", "bias")
    ]
    total = sum(samples)
    return {k: sum(n * s["model"][k] for n, s in zip(samples, store)) / total for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--round", type=int, help="the checkpoint's round (default: the newest)")
    args = parser.parse_args()
    try:
        cfg = resume_config(args.run_dir)
        if cfg.method.name != "fedbn":
            raise PlflError(f"{args.run_dir} is a {cfg.method.name} run; this reads FedBN runs.")
        directory = args.run_dir / "checkpoints"
        if args.round is None:
            path, state = load_latest_checkpoint(directory)
        else:
            path = checkpoint_path(directory, args.round)
            if not path.is_file():
                kept = ", ".join(sorted(p.name for p in list_checkpoints(directory))) or "none"
                raise PlflError(f"{path} does not exist (kept: {kept}); rerun with keep_checkpoints=N to keep more.")
            state = read_checkpoint(path)
        reported = dict(zip(*read_report_run(args.run_dir).series("accuracy")))
    except PlflError as e:
        sys.exit(f"fedbn_statistics.py: {e}")
    config = OmegaConf.to_object(cfg)
    data = load_federated_data(config.data, config.federation.seed)
    model = models()[config.model.name].of(config.model).build(data.input_shape, data.num_classes, data.vocab_size)
    shared = shared_affine(model, state["store"], [len(c.y_train) for c in data.clients])
    counts = {"evaluated": 0, "re-estimated": 0, "shared γ, β": 0}
    for client, stored in zip(data.clients, state["store"]):
        model.load_state_dict(stored["model"])  # the averaged weights under the client's BatchNorm layers
        counts["evaluated"] += correct(model, client.x_test, client.y_test)
        reestimate(model, client.x_train)
        counts["re-estimated"] += correct(model, client.x_test, client.y_test)
        model.load_state_dict({**stored["model"], **shared})
        reestimate(model, client.x_train)
        counts["shared γ, β"] += correct(model, client.x_test, client.y_test)
    total = sum(len(c.y_test) for c in data.clients)
    print(f"{args.run_dir}, {path.name}: the run's accuracy {100 * reported[state['round']]:.2f} %")
    for name, count in counts.items():
        print(f"{name}: {100 * count / total:.2f} %")


if __name__ == "__main__":
    main()
