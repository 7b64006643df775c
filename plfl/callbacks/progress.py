"""A rich progress bar over rounds, with ETA and a line per evaluated round."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from plfl.callbacks.base import FederationCallback, RoundResult, RunInfo


class RoundProgress(FederationCallback):
    """Shows rounds done / total, elapsed time and ETA on stderr."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)

    def on_fit_start(self, run: RunInfo) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.progress.start()
        self.task = self.progress.add_task(
            f"{run.config.name} rounds", total=run.config.federation.rounds + 1, completed=len(run.history)
        )

    def on_round_end(self, run: RunInfo, result: RoundResult) -> None:
        m = result.metrics
        if "accuracy" in m:
            loss = f"  train loss {m['train_loss']:.4f}" if "train_loss" in m else ""
            self.progress.console.print(
                f"round {result.round:>4}  accuracy {100 * m['accuracy']:6.2f} %  "
                f"worst 10 % {100 * m['worst10_accuracy']:6.2f} %{loss}  {m['seconds']:.1f} s"
            )
        self.progress.advance(self.task)

    def on_fit_end(self, run: RunInfo, summary: dict[str, Any]) -> None:
        self.progress.stop()

    on_fit_error = on_fit_end
