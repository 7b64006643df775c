"""Saves the federation's state after rounds, for ``plfl fit --resume`` (see plfl.checkpoint)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from plfl.callbacks.base import FederationCallback, RoundResult, RunInfo
from plfl.checkpoint import list_checkpoints, save_checkpoint


class Checkpoints(FederationCallback):
    """Writes ``checkpoints/round-<r>.pt`` after every ``every``-th round and after the last one,
    keeping the newest ``keep``; with ``keep`` None the newest two while the run goes and the last one alone
    once it completed (a finished run needs one to be extended with ``--resume``).

    ``state`` returns the complete state to save (``FederationLoop.state_dict``).
    A round that fails raises before its ``on_round_end``, so the newest
    checkpoint is always of a good round.
    """

    def __init__(self, state: Callable[[], dict[str, Any]], every: int, keep: Optional[int]):
        self.state = state
        self.every = every
        self.keep = keep

    def on_fit_start(self, run: RunInfo) -> None:
        self.directory = run.run_dir / "checkpoints"
        self.last_round = run.config.federation.rounds

    def on_round_end(self, run: RunInfo, result: RoundResult) -> None:
        if result.round % self.every == 0 or result.round == self.last_round:
            save_checkpoint(self.directory, result.round, self.state(), self.keep or 2)

    def on_fit_end(self, run: RunInfo, summary: dict[str, Any]) -> None:
        if self.keep is None:
            for old in list_checkpoints(self.directory)[1:]:
                old.unlink()
