"""plfl's FedOpt server step beside Flower's FedAdam, FedYogi and FedAdagrad strategies on the same inputs.

Usage: python benchmarks/fedopt_flower.py [--flower-python PATH] [--rounds 3] [--out DIR]

Flower runs in a subprocess of the interpreter given by ``--flower-python`` (default: this one, with plfl's
``flower`` extra installed; any one with ``flwr``): both sides get the same two-client example, float64 arrays of a
small model's shapes, uploads x_t + Δ_i with client 0 holding 10 samples and client 1 holding 30, for ``--rounds``
server rounds. Flower's strategies are driven through their ``aggregate_fit`` with those uploads.

Two comparisons per optimiser, printed as the largest |plfl − Flower| over every entry and round:

- ``as is``: both at the same η, β₁, β₂, τ (β₁ = 0 for FedAdagrad, which Flower fixes). plfl starts v at τ²
  (Alg. 2's v_{−1} ≥ τ², at its bound), Flower at 0; Flower's FedAdam also scales η by √(1 − β₂^{r+1}) / (1 −
  β₁^{r+1}) in server round r.
- ``Flower's v_0 and η_r``: plfl's rule with τ so small that τ² vanishes beside Δ², and with FedAdam's η replaced
  by Flower's η_r round by round. This is plfl's arithmetic with Flower's two choices; it must agree to float64
  rounding.

The figures go to ``--out`` as fedopt-vs-flower.csv.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from plfl.methods.fedopt import FedOptConfig, adaptive_server_step
from plfl.robust import weighted_average

SHAPES = {"body.weight": (4, 3), "body.bias": (4,), "head.weight": (2, 4), "head.bias": (2,)}
SAMPLES = (10, 30)
FLOWER_NAMES = {"adam": "FedAdam", "yogi": "FedYogi", "adagrad": "FedAdagrad"}

# Run by the Flower interpreter: reads {"strategy", "options" (its keyword arguments), "initial", "rounds": [[upload of
# each client]], "samples"} as JSON on stdin and prints the global model after each round as JSON.
FLOWER_SIDE = """
import json, sys
import numpy as np
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
import flwr.server.strategy as strategies

spec = json.load(sys.stdin)
arrays = lambda values: [np.asarray(v, dtype=np.float64) for v in values]
strategy = getattr(strategies, spec["strategy"])(
    initial_parameters=ndarrays_to_parameters(arrays(spec["initial"])), **spec["options"]
)
out = []
for server_round, uploads in enumerate(spec["rounds"], start=1):
    results = [
        (None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays(upload)), n, {}))
        for upload, n in zip(uploads, spec["samples"])
    ]
    parameters, _ = strategy.aggregate_fit(server_round, results, [])
    out.append([a.tolist() for a in parameters_to_ndarrays(parameters)])
print(json.dumps(out))
"""


def example(rounds: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], list[list[dict[str, torch.Tensor]]]]:
    """The initial global model and each round's client updates Δ_i (float64, drawn from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    initial = {k: torch.randn(shape, generator=g, dtype=torch.float64) for k, shape in SHAPES.items()}
    deltas = [
        [
            {k: 0.1 * torch.randn(shape, generator=g, dtype=torch.float64) for k, shape in SHAPES.items()}
            for _ in SAMPLES
        ]
        for _ in range(rounds)
    ]
    return initial, deltas


def plfl_side(config: FedOptConfig, initial, deltas, flower_eta: bool) -> list[dict[str, torch.Tensor]]:
    """plfl's global model after each round; with ``flower_eta``, FedAdam's η is Flower's η_r in round r."""
    x, moments, out = initial, None, []
    for server_round, round_deltas in enumerate(deltas, start=1):
        uploads = [{k: x[k] + d[k] for k in x} for d in round_deltas]
        step = config
        if flower_eta and config.server_optimizer == "adam":
            t = server_round + 1.0
            scale = math.sqrt(1 - config.beta2**t) / (1 - config.beta1**t)
            step = dataclasses.replace(config, server_lr=config.server_lr * scale)
        x, moments = adaptive_server_step(x, weighted_average(uploads, list(SAMPLES)), moments, step)
        out.append(x)
    return out


def flower_side(python: str, config: FedOptConfig, initial, deltas, plfl_models) -> list[dict[str, torch.Tensor]]:
    """Flower's global model after each round, its uploads built from plfl's models of the previous round (the
    same x_t as plfl's up to rounding, so that each round compares one step)."""
    previous = [initial] + plfl_models[:-1]
    spec = {
        "strategy": FLOWER_NAMES[config.server_optimizer],
        "options": {"eta": config.server_lr, "tau": config.tau}
        | ({} if config.server_optimizer == "adagrad" else {"beta_1": config.beta1, "beta_2": config.beta2}),
        "initial": [initial[k].tolist() for k in SHAPES],
        "rounds": [
            [[(x[k] + d[k]).tolist() for k in SHAPES] for d in round_deltas]
            for x, round_deltas in zip(previous, deltas)
        ],
        "samples": list(SAMPLES),
    }
    done = subprocess.run(
        [python, "-c", FLOWER_SIDE], input=json.dumps(spec), capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise SystemExit(f"Flower's side failed in {python}:\n{done.stderr[-2000:]}")
    rounds = json.loads(done.stdout.strip().splitlines()[-1])
    return [{k: torch.tensor(a, dtype=torch.float64) for k, a in zip(SHAPES, arrays)} for arrays in rounds]


def largest_difference(one: list[dict[str, torch.Tensor]], other: list[dict[str, torch.Tensor]]) -> float:
    return max((a[k] - b[k]).abs().max().item() for a, b in zip(one, other) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--flower-python", default=sys.executable, help="a Python interpreter with flwr installed (default: this one)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="directory for fedopt-vs-flower.csv")
    args = parser.parse_args()

    initial, deltas = example(args.rounds)
    rows = []
    for optimizer in FLOWER_NAMES:
        for comparison, tau, flower_eta in (("as is", 1e-3, False), ("Flower's v_0 and η_r", 1e-9, True)):
            # Flower's FedAdagrad fixes β₁ = 0 (no first moment); plfl takes Alg. 2's β₁ for every optimiser.
            beta1 = 0.0 if optimizer == "adagrad" else 0.9
            config = FedOptConfig(server_optimizer=optimizer, server_lr=0.1, beta1=beta1, beta2=0.99, tau=tau)
            ours = plfl_side(config, initial, deltas, flower_eta)
            theirs = flower_side(args.flower_python, config, initial, deltas, ours)
            moved = largest_difference(ours, [initial] + ours[:-1])
            rows.append(
                {
                    "strategy": FLOWER_NAMES[optimizer],
                    "comparison": comparison,
                    "tau": tau,
                    "rounds": args.rounds,
                    "largest_step": f"{moved:.3e}",
                    "largest_difference": f"{largest_difference(ours, theirs):.3e}",
                }
            )
    header = list(rows[0])
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(str(row[k]) for k in header))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "fedopt-vs-flower.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, header)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
