"""From a validated config to a finished run directory."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import DictConfig, OmegaConf

from plfl.callbacks import FederationCallback, RoundProgress, RunFiles, RunInfo, WandbRun
from plfl.client import ClientModule, LocalTrainer, build_trainer
from plfl.config import FederationConfig
from plfl.data import load_federated_data
from plfl.federation import FederationLoop
from plfl.methods import FederationContext, method_class
from plfl.models import build_model
from plfl.state import ClientStateStore


def run_experiment(cfg: DictConfig) -> tuple[Path, dict[str, Any]]:
    """Load the data, build model, method and callbacks, and run the federation.

    Everything that can fail on bad input (data files, model/data mismatch,
    method options) is checked before the run directory is created.

    Returns:
        The run directory (``<output_dir>/<name>/<time>/``) and the summary.

    Raises:
        PlflError: bad data or config (nothing is written).
        Exception: a failure during training; the run directory then holds
            the results so far and a summary.json with ``status: failed``.
    """
    federation: FederationConfig = OmegaConf.to_object(cfg.federation)
    L.seed_everything(federation.seed, verbose=False)
    data = load_federated_data(OmegaConf.to_object(cfg.data), federation.seed)
    model = build_model(cfg.model.name, data.input_shape, data.num_classes, cfg.model.hidden_sizes)
    initial_params = {k: v.detach().clone() for k, v in model.state_dict().items()}

    module = ClientModule(model, data.num_classes, federation.lr, federation.momentum)
    local_trainer = LocalTrainer(module, build_trainer(**cfg.trainer), federation.batch_size)
    context = FederationContext(data, ClientStateStore(len(data.clients)), model, local_trainer, federation)
    method_cls = method_class(cfg.method.name)
    method = method_cls(OmegaConf.to_object(cfg.method), context, initial_params)

    run_dir = new_run_dir(Path(cfg.output_dir) / cfg.name)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    run = RunInfo(cfg, run_dir, len(data.clients), sum(p.numel() for p in model.parameters()))
    loop = FederationLoop(method, context, build_callbacks(cfg), run)
    return run_dir, loop.run()


def build_callbacks(cfg: DictConfig) -> list[FederationCallback]:
    """The callbacks the config asks for: result files always, W&B and the progress bar on request."""
    callbacks: list[FederationCallback] = [RunFiles(metrics=cfg.logger.name != "none")]
    if cfg.logger.name == "wandb":
        callbacks.append(WandbRun(cfg.logger.project, cfg.logger.entity))
    if cfg.progress_bar:
        callbacks.append(RoundProgress())
    return callbacks


def new_run_dir(parent: Path) -> Path:
    """A fresh ``parent/<YYYYmmdd-HHMMSS>[-k]`` directory (``-k`` when the second is taken)."""
    parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for k in range(1000):
        path = parent / (stamp if k == 0 else f"{stamp}-{k}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a new run directory under {parent}")
