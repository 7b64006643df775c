"""Saves the federation's state after rounds, for ``plfl fit --resume`` (see plfl.checkpoint)."""

from __future__ import annotations

from typing import Any, Callable

from plfl.callbacks.base import FederationCallback, RoundResult, RunInfo
from plfl.checkpoint import save_checkpoint


class Checkpoints(FederationCallback):
    """Writes ``checkpoints/round-<r>.pt`` after every ``every``-th round and after the last one,
    keeping the newest ``keep``.

    ``state`` returns the complete state to save (``FederationLoop.state_dict``).
    A round that fails raises before its ``on_round_end``, so the newest
    checkpoint is always of a good round.
    """

    def __init__(self, state: Callable[[], dict[str, Any]], every: int, keep: int):
        self.state = state
        self.every = every
        self.keep = keep

    def on_fit_start(self, run: RunInfo) -> None:
        self.directory = run.run_dir / "checkpoints"
        self.last_round = run.config.federation.rounds

    def on_round_end(self, run: RunInfo, result: RoundResult) -> None:
        if result.round % self.every == 0 or result.round == self.last_round:
            save_checkpoint(self.directory, result.round, self.state(), self.keep)
