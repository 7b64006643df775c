"""Shared fixtures and helpers: tiny in-memory federations, contexts and executors for method hooks, and paths
to the shared real data."""

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from plfl.callbacks import RunInfo
from plfl.client_side import LocalClients
from plfl.config import validate
from plfl.data import ClientData, FederatedData
from plfl.executors import Executor, SequentialExecutor, drive
from plfl.executors.options import ClientWorkOptions
from plfl.federation import FederationLoop
from plfl.methods import method_class, methods
from plfl.methods.base import FederationContext
from plfl.models import build_model
from plfl.sections import FederationConfig, TrainerConfig
from plfl.state import ClientStateStore
from plfl.tasks import ClientFailure, resolved

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
FEDALA_MNIST = SHARED_DATA / "fedala-mnist-dir0.1"


def load_script(path: Path) -> ModuleType:
    """A script of ``benchmarks/`` (no package) as a module, registered under its file name; its folder on
    ``sys.path``, as ``python benchmarks/NAME.py`` has it, so that the scripts' shared modules import."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = sys.modules[path.stem] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main(script: ModuleType, capsys, *args: str) -> subprocess.CompletedProcess:
    """``script.main()`` with the command-line arguments ``args``, in this process (torch is imported already):
    its exit status (``sys.exit(message)`` is 1, the message on stderr), stdout and stderr."""
    argv = [script.__file__, *args]
    code = None
    with mock.patch.object(sys, "argv", argv):
        try:
            script.main()
        except SystemExit as exit_:
            code = exit_.code
    printed = capsys.readouterr()
    status = code if isinstance(code, int) else int(code is not None)
    return subprocess.CompletedProcess(argv, status, printed.out, printed.err + (code if isinstance(code, str) else ""))


# One torch thread in this process and in every run and subprocess it starts (plfl's federation.threads reads
# OMP_NUM_THREADS): the tests' federations are tiny, and tests run beside other jobs, where a second thread stalls.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


@pytest.fixture
def tiny_federation() -> FederatedData:
    """4 clients, 8 features, 3 classes; client i holds 10·(i+1) training samples."""
    g = torch.Generator().manual_seed(0)
    clients = []
    for i in range(4):
        n = 10 * (i + 1)
        clients.append(
            ClientData(
                torch.randn(n, 8, generator=g),
                torch.randint(0, 3, (n,), generator=g),
                torch.randn(6, 8, generator=g),
                torch.randint(0, 3, (6,), generator=g),
            )
        )
    return FederatedData("tiny", clients, num_classes=3, input_shape=(8,))


def reads_shared_data(path: Path):
    """Marks a test that reads `path` from the shared real data: slow tier, skipped where the path is missing."""
    skip = pytest.mark.skipif(not path.exists(), reason=f"shared data not found at {path}")
    return lambda test: pytest.mark.slow(skip(test))


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
        base = {
            "output_dir": str(tmp_path),
            "progress_bar": False,
            "data": {"source": "digits", "num_clients": 5, "beta": 0.5},
            "model": {"name": "mlp", "hidden_sizes": [32]},
            "federation": {"rounds": 3, "lr": 0.05, "batch_size": 20},
        }
        return validate(OmegaConf.merge(base, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()])))

    return make


def last_metrics(run_dir: Path) -> dict[str, str]:
    """The last row of a run's metrics.csv, column name → cell text."""
    header, *rows = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()]
    return dict(zip(header, rows[-1]))


def make_context(data: FederatedData, model: Optional[nn.Module] = None, **federation) -> tuple:
    """(A FederationContext over ``data``, its architecture): ``model``, by default an MLP with 16 hidden units;
    ``federation`` options over lr 0.1 and batch size 5."""
    model = model or build_model("mlp", data.input_shape, data.num_classes, hidden_sizes=[16])
    options = FederationConfig(**{"lr": 0.1, "batch_size": 5, **federation})
    return FederationContext(data, ClientStateStore(len(data.clients)), options, model), model


_executors: dict[int, tuple[FederationContext, SequentialExecutor]] = {}


def sequential(context: FederationContext) -> SequentialExecutor:
    """The sequential executor of ``context``'s config and architecture (one per context)."""
    if id(context) not in _executors or _executors[id(context)][0] is not context:
        work = ClientWorkOptions(context.federation, TrainerConfig(), context.augment)
        _executors[id(context)] = context, SequentialExecutor.of(work, context.data, context.architecture)
    return _executors[id(context)][1]


def run_hook(context: FederationContext, value, executor: Optional[Executor] = None):
    """A method hook's value, the tasks it yields (if any) run by ``executor`` (default: :func:`sequential`), as
    the federation loop runs them."""
    (outcome,) = drive([resolved(value)], executor or sequential(context))
    assert not isinstance(outcome, ClientFailure), outcome
    return outcome


def run_loop(method, context: FederationContext, executor: Optional[Executor] = None) -> FederationLoop:
    """``method``'s federation over ``context``, run to its last round without callbacks."""
    clients = LocalClients(method, context.store, executor or sequential(context))
    loop = FederationLoop(method, context, clients, [], RunInfo(None, Path("."), len(context.data.clients), 0))
    loop.run()
    return loop


# The methods whose runs on every executor and resumes stay in the fast tier (pytest -m "not slow"), between them
# the kinds of client work: plain and momentum SGD with short last batches (fedavg), a method's step tasks on
# ordered samples, an epoch at a time (fedala's ALA) and bi-level steps (pfedme). The slow tier runs every method.
FAST_METHODS = ("fedala", "fedavg", "pfedme")


def every_method() -> list:
    """Every registered method as a test parameter, those outside :data:`FAST_METHODS` in the slow tier."""
    return [pytest.param(m, marks=[] if m in FAST_METHODS else [pytest.mark.slow]) for m in sorted(methods())]


def matrix_config(output_dir: Path, method: str, executor: str, **overrides):
    """A validated config of ``method`` on 5 digits clients (MLP, 3 rounds) run by ``executor``, with the
    method's own ``matrix_options`` (the executor matrix: every method on every executor)."""
    base = {
        "output_dir": str(output_dir),
        "progress_bar": False,
        "data": {"source": "digits", "num_clients": 5, "beta": 0.5},
        "model": {"name": "mlp", "hidden_sizes": [32]},
        "federation": {"rounds": 3, "lr": 0.05, "batch_size": 20, "executor": executor},
        "method": {"name": method},
    }
    options = {**method_class(method).__dict__.get("matrix_options", {}), **overrides}
    return validate(OmegaConf.merge(base, OmegaConf.from_dotlist([f"{k}={v}" for k, v in options.items()])))


def run_results(run_dir: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """(metrics.csv rows, clients.csv rows, without the wall-clock column; every client's final model)."""
    from plfl.checkpoint import load_latest_checkpoint

    def rows(name: str) -> list[dict]:
        with open(run_dir / name) as f:
            return [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(f)]

    store = load_latest_checkpoint(run_dir / "checkpoints")[1]["store"]
    return rows("metrics.csv"), rows("clients.csv"), [client["model"] for client in store]


@pytest.fixture(scope="session")
def sequential_results(tmp_path_factory):
    """method → :func:`run_results` of its matrix run on the sequential executor (run once per session)."""
    from plfl.experiment import run_experiment

    cache: dict = {}

    def results(method: str) -> tuple:
        if method not in cache:
            cache[method] = run_results(
                run_experiment(matrix_config(tmp_path_factory.mktemp(method), method, "sequential"))[0]
            )
        return cache[method]

    return results
