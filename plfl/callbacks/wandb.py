"""Weights & Biases logging through Lightning's WandbLogger (works with WANDB_MODE=offline)."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from plfl.callbacks.base import FederationCallback, RoundResult, RunInfo

RUN_ID_FILE = "wandb_run_id"  # in the run directory


class WandbRun(FederationCallback):
    """Logs each round's metrics against the step metric ``round``, a histogram of
    per-client accuracies, the method's tables (``wandb.Table``, e.g. pFedLA's
    aggregation weights for a heatmap) and the summary; the run directory holds the W&B files."""

    def __init__(self, project: str, entity: str | None = None):
        self.project = project
        self.entity = entity

    def on_fit_start(self, run: RunInfo) -> None:
        from lightning.pytorch.loggers import WandbLogger

        id_file = run.run_dir / RUN_ID_FILE
        # plfl fit --resume continues the run's W&B run (rounds from the checkpoint on are logged again,
        # against the step metric ``round``); a new run takes the id W&B or its sweep agent gives it.
        resume = {"id": id_file.read_text().strip(), "resume": "allow"} if run.history and id_file.is_file() else {}
        self.logger = WandbLogger(
            project=self.project, entity=self.entity, name=run.config.name, save_dir=str(run.run_dir),
            config=OmegaConf.to_container(run.config, resolve=True), **resume,
        )
        experiment = self.logger.experiment
        id_file.write_text(experiment.id + "\n")
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

