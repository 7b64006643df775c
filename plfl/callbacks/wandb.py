"""Weights & Biases logging through Lightning's WandbLogger (works with WANDB_MODE=offline)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from plfl.callbacks.base import FederationCallback, RoundResult, RunInfo


class WandbRun(FederationCallback):
    """Logs each round's metrics against the step metric ``round``, a histogram of
    per-client accuracies, the method's tables (``wandb.Table``, e.g. pFedLA's
    aggregation weights for a heatmap) and the summary; the run directory holds the W&B files."""

    def __init__(self, project: str, entity: str | None = None):
        self.project = project
        self.entity = entity

    def on_fit_start(self, run: RunInfo) -> None:
        from lightning.pytorch.loggers import WandbLogger

        self.logger = WandbLogger(
            project=self.project, entity=self.entity, name=run.config.name, save_dir=str(run.run_dir),
            config=OmegaConf.to_container(run.config, resolve=True),
            # One W&B run per run directory: plfl fit --resume continues it (its rounds are logged again
            # from the checkpoint on, against the step metric ``round``).
            id=wandb_run_id(run.run_dir), resume="allow" if run.history else None,
        )
        experiment = self.logger.experiment
        experiment.define_metric("round")
        experiment.define_metric("*", step_metric="round")

    def on_round_end(self, result: RoundResult) -> None:
        import wandb

        metrics: dict[str, Any] = dict(result.metrics)
        if result.clients:
            metrics["client_accuracy"] = wandb.Histogram([c["accuracy"] for c in result.clients])
        for name, rows in result.tables.items():
            columns = list(dict.fromkeys(key for row in rows for key in row))
            metrics[name] = wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.logger.experiment.log(metrics)

    def on_fit_end(self, summary: dict[str, Any]) -> None:
        self.logger.experiment.summary.update(summary)
        self.logger.experiment.finish()

    def on_fit_error(self, summary: dict[str, Any]) -> None:
        self.logger.experiment.summary.update(summary)
        self.logger.experiment.finish(exit_code=1)


def wandb_run_id(run_dir: Path) -> str:
    """A W&B run id that names ``run_dir``: its time stamp and a hash of its absolute path."""
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return f"{run_dir.name}-{digest}"
