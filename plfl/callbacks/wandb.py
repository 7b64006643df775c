"""Weights & Biases logging (works with WANDB_MODE=offline)."""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any

from omegaconf import OmegaConf

from plfl.callbacks.base import FederationCallback, RoundResult, RunInfo
from plfl.errors import PlflWarning

RUN_ID_FILE = "wandb_run_id"  # in the run directory: the W&B run that plfl fit --resume continues


class WandbRun(FederationCallback):
    """Logs each round's metrics against the step metric ``round``, a histogram of
    per-client accuracies, the method's tables (``wandb.Table``, e.g. pFedLA's
    aggregation weights for a heatmap) and the summary; the run directory holds the W&B files.

    Round r is W&B's history step ``_step`` r, in every W&B run. W&B writes its
    records to disk (offline) or to the server (online) every few seconds (15 s
    for the offline ``.wandb`` file in wandb 0.31), so a killed run may have lost
    its last rounds there, the checkpoint's round included, while it may also
    have logged rounds after the checkpoint. ``plfl fit --resume`` therefore
    rewinds the W&B run named in ``wandb_run_id`` to round 0
    (``wandb.init(resume_from="<id>?_step=0")``: W&B keeps step 0 and drops the
    later steps) and logs rounds 1..k again from the checkpoint of round k, then
    the new rounds: every round once. Offline, the rewind point is stored in the
    new ``.wandb`` file and ``wandb sync`` applies it when it uploads that file.

    Where the rewind cannot happen (``wandb.init`` raises, e.g. a server without
    W&B's run-rewind feature, or a sweep agent gave this process another run id
    in ``WANDB_RUN_ID``), a new W&B run logs rounds 0..k from the checkpoint and
    then the new ones, with ``resumed_from: {run_id: <old id>, round: k}`` in its
    config; a :class:`PlflWarning` says so, and ``wandb_run_id`` names the new run.

    W&B's own banners and notices are silenced unless ``verbose``.
    """

    def __init__(self, project: str, entity: str | None = None, verbose: bool = False):
        self.project = project
        self.entity = entity
        self.verbose = verbose

    def on_fit_start(self, run: RunInfo) -> None:
        import wandb

        id_file = run.run_dir / RUN_ID_FILE
        options = dict(
            project=self.project,
            entity=self.entity,
            name=run.config.name,
            dir=str(run.run_dir),
            config=OmegaConf.to_container(run.config, resolve=True),
            settings=wandb.Settings(silent=not self.verbose),
        )
        kept = -1  # the last round that the W&B run already has
        if run.history and id_file.is_file():
            self.experiment, kept = _continue(options, id_file.read_text().strip(), run.history[-1].round)
        else:  # W&B, or its sweep agent, gives the id
            self.experiment = _start(options)
        id_file.write_text(self.experiment.id + "\n")
        self.experiment.define_metric("round")
        self.experiment.define_metric("*", step_metric="round")
        for result in run.history:
            if result.round > kept:
                self.on_round_end(run, result)

    def on_round_end(self, run: RunInfo, result: RoundResult) -> None:
        import wandb

        metrics: dict[str, Any] = dict(result.metrics)
        if result.clients:
            metrics["client_accuracy"] = wandb.Histogram([c["accuracy"] for c in result.clients])
        for name, rows in result.tables.items():
            columns = list(dict.fromkeys(key for row in rows for key in row))
            metrics[name] = wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        # An explicit step keeps _step = round in a W&B run that starts after round 0; without commit=True
        # W&B would hold the row back until the next step.
        self.experiment.log(metrics, step=result.round, commit=True)

    def on_fit_end(self, run: RunInfo, summary: dict[str, Any]) -> None:
        self.experiment.summary.update(summary)
        self.experiment.finish()

    def on_fit_error(self, run: RunInfo, summary: dict[str, Any]) -> None:
        """A failed run ends with exit code 1; a stopped one is marked preempted (W&B's state for a run that
        will be continued: ``plfl fit --resume`` does) and ends with the signal's exit status."""
        self.experiment.summary.update(summary)
        if summary["status"] == "interrupted":
            self.experiment.mark_preempting()
            self.experiment.finish(exit_code=128 + signal.Signals[summary["signal"]])
        else:
            self.experiment.finish(exit_code=1)


def _start(options: dict[str, Any], **init: Any):
    """A W&B run: ``wandb.init`` with ``options`` and ``init``; by default it continues a run of the id W&B was
    given (``WANDB_RUN_ID``, as a sweep agent sets it) rather than failing on it."""
    import wandb

    return wandb.init(**{"resume": "allow", **options, **init})


def _continue(options: dict[str, Any], run_id: str, round_: int) -> tuple[Any, int]:
    """W&B run ``run_id`` rewound to round 0, or else a new run whose config names it and the
    checkpoint's ``round_``; with the last round that the returned run keeps (0, or -1 for none)."""
    import wandb

    given_id = os.environ.get(wandb.env.RUN_ID)
    if given_id and given_id != run_id:  # resume_from would take the run away from the sweep agent
        reason = f"W&B gave this process the run id {given_id} (WANDB_RUN_ID, e.g. from a sweep agent)"
    else:
        try:
            return _start(options, resume=None, resume_from=f"{run_id}?_step=0"), 0
        except wandb.errors.Error as error:
            reason = f"wandb.init could not rewind it: {error}"
    warnings.warn(
        PlflWarning(
            f"W&B run {run_id} is not continued: {reason}. A new W&B run logs rounds 0-{round_} from the checkpoint "
            f"and then the new rounds; its config has resumed_from: {{run_id: {run_id}, round: {round_}}}."
        ),
        stacklevel=2,
    )
    config = {**options["config"], "resumed_from": {"run_id": run_id, "round": round_}}
    return _start({**options, "config": config}), -1
