"""Progress on stderr: the run directory when the run starts (:class:`RunStart`, whatever the progress setting),
a line per round, and what happens inside a round (:class:`RoundProgress`).

On a terminal, a live display (rich) holds two lines: the rounds done of the run's, with elapsed time and ETA,
and the current round's phase (training, broadcast, evaluation), the work an executor runs (training, ALA's
weight learning, a method's own steps, evaluation), its clients done, the steps taken, and the ETAs of the round
and the run (:mod:`plfl.activity`). Without a terminal (a log file, CI, Slurm) it prints one line per round with
its seconds, accuracy and the run's ETA, and the inside-a-round line every ``heartbeat_s`` seconds, so that
slow work and a hang look different in a log too.

ETAs come from the measured seconds of the finished training rounds (the mean of the last three); before one
has finished, from the clients trained so far in the first training round.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Optional

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from plfl.activity import current as activity
from plfl.callbacks.base import FederationCallback, RoundResult, RunInfo


def clock(seconds: Optional[float]) -> str:
    """``H:MM:SS``, or ``-:--:--`` when unknown."""
    if seconds is None:
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class RunStart(FederationCallback):
    """The run directory and torch's CPU threads on ``console`` (default: stderr) when the run starts or resumes,
    with or without a progress display: a batch job's log names the directory before the first round."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True, soft_wrap=True)

    def on_fit_start(self, run: RunInfo) -> None:
        threads = run.config.federation.threads  # the count the run chose, recorded in its config
        self.console.print(f"Run directory: {run.run_dir} (torch threads: {threads})", highlight=False)


class RoundProgress(FederationCallback):
    """The progress of a run on ``console`` (default: stderr); see the module docstring."""

    def __init__(self, console: Console | None = None, heartbeat_s: float = 30.0):
        self.console = console or Console(stderr=True, soft_wrap=True)  # a log keeps a line a line
        self.heartbeat_s = heartbeat_s
        self.live: Optional[Live] = None
        self.stopped = threading.Event()

    def on_fit_start(self, run: RunInfo) -> None:
        self.rounds = run.config.federation.rounds
        self.durations = [r.metrics["seconds"] for r in run.history if r.round > 0]
        if self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task(f"{run.config.name} rounds", total=self.rounds + 1)
            self.progress.update(self.task, completed=len(run.history))
            self.live = Live(Group(self.progress, _Line(self.inside_round)), console=self.console, transient=True)
            self.live.start()
        else:
            threading.Thread(target=self._heartbeat, daemon=True).start()

    def on_round_end(self, run: RunInfo, result: RoundResult) -> None:
        if result.round > 0:
            self.durations.append(result.metrics["seconds"])
        self.console.print(self.round_line(result))
        if self.live is not None:
            self.progress.advance(self.task)

    def on_fit_end(self, run: RunInfo, summary: dict[str, Any]) -> None:
        self.stopped.set()
        if self.live is not None:
            self.live.stop()

    on_fit_error = on_fit_end

    def round_line(self, result: RoundResult) -> str:
        """A finished round: its accuracy (when evaluated), training loss, seconds and the run's ETA."""
        m = result.metrics
        text = f"round {result.round:>4}/{self.rounds}"
        if "accuracy" in m:
            text += f"  accuracy {100 * m['accuracy']:6.2f} %  worst 10 % {100 * m['worst10_accuracy']:6.2f} %"
        if m.get("train_loss") is not None:
            text += f"  train loss {m['train_loss']:.4f}"
        per_round = self.per_round()
        left = None if per_round is None else (self.rounds - result.round) * per_round
        return text + f"  {m['seconds']:.1f} s  ETA {clock(left)}"

    def inside_round(self) -> str:
        """The current round: phase, work, clients done, steps, seconds so far, and the round's and run's ETA."""
        a = activity
        if a.round is None:
            return "starting"
        elapsed = time.monotonic() - a.round_started
        work = f" {a.work}" if a.work and a.work != a.phase else ""
        clients = f", {a.done}/{a.total} clients" if a.total else ""
        per_round = self.per_round(elapsed)
        round_left = None if per_round is None else max(per_round - elapsed, 0.0)
        run_left = None if per_round is None else round_left + (self.rounds - a.round) * per_round
        return (
            f"round {a.round}: {a.phase}{work}{clients}, {a.steps:,} steps, {elapsed:.0f} s; "
            f"ETA round {clock(round_left)}, run {clock(run_left)}"
        )

    def per_round(self, elapsed: Optional[float] = None) -> Optional[float]:
        """Seconds a training round takes: the mean of the last three finished ones; before any, the first
        training round's pace so far (``elapsed`` seconds for the clients trained); None when unknown."""
        if self.durations:
            return statistics.fmean(self.durations[-3:])
        a = activity
        if elapsed is not None and a.phase == "training" and a.done:
            return elapsed / a.done * a.total
        return None

    def _heartbeat(self) -> None:
        while not self.stopped.wait(self.heartbeat_s):
            self.console.print(self.inside_round())


class _Line:
    """A live display's line, rendered anew at every refresh."""

    def __init__(self, text: Any):
        self.text = text

    def __rich__(self) -> Text:
        return Text(self.text())
