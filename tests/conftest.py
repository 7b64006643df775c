"""Shared fixtures: tiny in-memory federations and paths to the shared real data."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from plfl.config import validate
from plfl.data import ClientData, FederatedData

ROOT = Path(__file__).resolve().parents[1]
FEDALA_MNIST = ROOT.parent / "shared" / "data" / "fedala-mnist-dir0.1"

# Small models at batches of 10-20: a second intra-op thread mostly spin-waits. With other processes
# on the two cores it made runs 3-7x slower (quickstart 297 s vs 42 s) for the same results.
torch.set_num_threads(1)


@pytest.fixture
def tiny_federation() -> FederatedData:
    """4 clients, 8 features, 3 classes; client i holds 10·(i+1) training samples."""
    g = torch.Generator().manual_seed(0)
    clients = []
    for i in range(4):
        n = 10 * (i + 1)
        clients.append(ClientData(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g),
                                  torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)))
    return FederatedData("tiny", clients, num_classes=3, input_shape=(8,))


@pytest.fixture
def fedala_mnist() -> Path:
    """FedALA's MNIST Dir(0.1) federation in PFLlib's format (../shared/data); skips the test without it."""
    if not FEDALA_MNIST.is_dir():
        pytest.skip(f"shared data not found at {FEDALA_MNIST}")
    return FEDALA_MNIST


@pytest.fixture(autouse=True)
def no_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")


@pytest.fixture
def digits_config(tmp_path):
    """A factory of validated configs: 5 digits clients, MLP, 3 rounds, output in tmp_path; kwargs override keys."""

    def make(**overrides):
        base = {"output_dir": str(tmp_path), "progress_bar": False,
                "data": {"source": "digits", "num_clients": 5, "beta": 0.5},
                "model": {"name": "mlp", "hidden_sizes": [32]},
                "federation": {"rounds": 3, "lr": 0.05, "batch_size": 20}}
        return validate(OmegaConf.merge(base, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()])))

    return make


def last_metrics(run_dir: Path) -> dict[str, str]:
    """The last row of a run's metrics.csv, column name → cell text."""
    header, *rows = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()]
    return dict(zip(header, rows[-1]))
