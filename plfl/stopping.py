"""Stopping a run on request: Ctrl+C (SIGINT) or SIGTERM, which Slurm, Kubernetes, systemd and ``timeout`` send
before SIGKILL.

Within :func:`stop_on_signals` the first of these signals raises :class:`Stopped` in the main thread wherever
it runs: between the batches of a local epoch, in ALA's weight learning, in evaluation, while the driver waits
for Ray's actors. The federation loop then ends the run as interrupted (the checkpoints of finished rounds stay,
``summary.json`` says ``status: interrupted``) and ``plfl`` exits with 128 + the signal's number (130, 143).
A second signal exits at once, without that bookkeeping.

:class:`Stopped` derives from ``BaseException``: a client's failure handling (``except Exception``) must not
take it for a failed client, and Lightning, which turns ``KeyboardInterrupt`` into ``sys.exit(1)``, re-raises
it unchanged.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from typing import Iterator, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """A run stopped by signal ``signum``; ``run_dir`` and ``round`` (the last finished round, None before
    round 0 finished) are set by the federation loop once the run's files are written."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.run_dir: Optional[os.PathLike] = None
        self.round: Optional[int] = None

    @property
    def name(self) -> str:
        """SIGINT or SIGTERM."""
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        """128 + the signal's number, as a shell reports a process killed by it: 130 (SIGINT), 143 (SIGTERM)."""
        return 128 + self.signum


_received: list[int] = []  # the signals seen within stop_on_signals
_pending: list[int] = []  # a signal that arrived in a deferred() block, raised when the block ends
_deferring = 0  # depth of deferred() blocks


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise :class:`Stopped` (at the end of a :func:`deferred` block when one runs);
    a second one ends the process at once (``os._exit``). Enter it in the main thread; the previous handlers
    come back on exit."""

    def handler(signum: int, frame: object) -> None:
        if _received:
            os._exit(128 + signum)
        _received.append(signum)
        if _deferring:
            _pending.append(signum)
        else:
            raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _received.clear()
        _pending.clear()


@contextmanager
def deferred() -> Iterator[None]:
    """Within: a stopping signal takes effect when the block ends, so that what it writes (a round's result
    files and checkpoint) is written whole."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        if not _deferring and _pending:
            raise Stopped(_pending.pop())
