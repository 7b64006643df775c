"""What a run is doing now, for progress displays: its round and phase, the work an executor runs, how many of
that call's clients are done, and the optimisation steps taken.

The federation loop sets the round and the phase (training, broadcast, evaluation); executors name the work of
each call (training, a method's own steps such as ALA, evaluation) and count finished clients and steps
(mini-batches; a lock-step of k clients counts k). One process-wide :data:`current`, as there is one run and one
progress display per process; a display reads it from its own thread, where a slightly stale value is harmless.
Work on Ray's actors is counted by the driver, client by client, without its steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Activity:
    """The current round (None before the first), phase and work, clients ``done`` of the work's ``total``,
    ``steps`` taken in the round, and when the round started (``time.monotonic`` seconds)."""

    round: int | None = None
    phase: str = ""
    work: str = ""
    done: int = 0
    total: int = 0
    steps: int = 0
    round_started: float = field(default_factory=time.monotonic)

    def start_round(self, round_: int) -> None:
        self.round, self.steps, self.round_started = round_, 0, time.monotonic()

    def start_phase(self, phase: str) -> None:
        self.phase, self.work, self.done, self.total = phase, "", 0, 0

    def start_work(self, work: str, clients: int) -> None:
        """An executor call of ``clients`` clients' ``work`` begins."""
        self.work, self.done, self.total = work, 0, clients

    def finish_clients(self, count: int = 1) -> None:
        self.done += count

    def add_steps(self, count: int = 1) -> None:
        self.steps += count


current = Activity()
