"""Checkpoint files: a federation's complete state after a round, written atomically, read without running code.

``<run dir>/checkpoints/round-<r>.pt`` holds one line with the SHA-256 hex
digest of the rest, then the state as ``torch.save`` writes it. A file is
written to a temporary name, fsynced and renamed, so a crash leaves either
the old set of checkpoints or the new one; the digest catches truncation
and corruption after the fact. Reading uses ``torch.load(weights_only=True)``,
which refuses pickled code: the state is tensors, numbers, strings, and
dicts, lists and tuples of them.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from plfl.errors import PlflError, PlflWarning

NAME = re.compile(r"round-(\d+)\.pt")
DIGEST_SIZE = 64  # hex digits of a SHA-256 digest


class CorruptCheckpoint(PlflError):
    """A checkpoint file is truncated, altered, or not a plfl checkpoint."""


def checkpoint_path(directory: Path, round_: int) -> Path:
    return directory / f"round-{round_:05d}.pt"


def save_checkpoint(directory: Path, round_: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``round_`` and delete all but the newest ``keep`` checkpoints.

    Returns the path written. ``keep`` ≥ 1.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, round_)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w+b") as f:
        # torch.save streams into the file (no copy of the state in memory); the digest is filled in after.
        f.write(b"0" * DIGEST_SIZE + b"\n")
        torch.save(state, f)
        f.seek(DIGEST_SIZE + 1)
        digest = hashlib.sha256()
        while chunk := f.read(1 << 20):
            digest.update(chunk)
        f.seek(0)
        f.write(digest.hexdigest().encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_directory(directory)
    for old in list_checkpoints(directory)[keep:]:
        old.unlink()
    return path


def list_checkpoints(directory: Path) -> list[Path]:
    """The checkpoint files in ``directory``, newest round first (none if it does not exist)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The state saved in ``path``.

    Raises:
        CorruptCheckpoint: the file is truncated or altered (digest mismatch), its content is not
            the zip archive ``torch.save`` writes (e.g. a bare pickle), or not a state that loads
            with ``weights_only=True`` (e.g. pickled code).
    """
    with open(path, "rb") as f:  # read in pieces: only the loaded state is held in memory
        expected = f.readline().removesuffix(b"\n")
        start = f.tell()
        digest = hashlib.sha256()
        while chunk := f.read(1 << 20):
            digest.update(chunk)
        if digest.hexdigest().encode() != expected:
            raise CorruptCheckpoint(f"{path} is truncated or corrupt (its SHA-256 digest does not match).")
        f.seek(start)
        if not zipfile.is_zipfile(f):
            # torch.save writes a zip archive; torch.load would take anything else for its legacy format,
            # whose reader warns about the pickle protocol before refusing or loading it.
            raise CorruptCheckpoint(
                f"{path} cannot be loaded safely: it is not the zip archive torch.save "
                "writes (a raw pickle or another format), so it is not a plfl checkpoint."
            )
        f.seek(start)
        try:
            return torch.load(f, weights_only=True)
        except Exception as e:  # noqa: BLE001  torch raises several types for unreadable or unsafe content
            raise CorruptCheckpoint(f"{path} cannot be loaded safely: {type(e).__name__}: {e}") from None


def load_latest_checkpoint(directory: Path) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint in ``directory`` that reads back intact; a damaged newer one is skipped with a warning.

    Raises:
        PlflError: no checkpoint file, or none that is intact.
    """
    paths = list_checkpoints(directory)
    for path in paths:
        try:
            return path, read_checkpoint(path)
        except CorruptCheckpoint as e:
            warnings.warn(PlflWarning(f"{e} Using the checkpoint before it."), stacklevel=2)
    what = "no checkpoint" if not paths else "no intact checkpoint"
    raise PlflError(
        f"{directory.parent} has {what} ({directory}/round-*.pt): the run stopped before its first "
        f"checkpoint or saves none (checkpoint_every=0). Start it again with "
        f"plfl fit --config {directory.parent / 'config.yaml'}."
    )


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable: a crash right after it must not bring the old directory entry back."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
