"""LEAF's Shakespeare next-character task, built from a plain play text.

LEAF (Caldas et al., "LEAF: A Benchmark for Federated Settings", arXiv:1812.01097;
``data/shakespeare/preprocess`` and ``utils/split_data.py`` of TalwalkarLab/leaf) makes each
speaking role of each play a client, and from a role's lines (one per text line, in text order):

- collapses runs of two or more spaces into one;
- predicts every character of every line, its closing newline included, from the 80 characters
  before it *in the same line*, the line being prefixed by 80 spaces (LEAF's unknown/padding
  symbol): a line of ``m`` characters plus its newline gives ``m + 1`` samples;
- splits the role's samples in text order: train = the first ``int(0.8 n)``, test = the samples
  from ``int(0.8 n) + 79`` on. The 79 samples between are dropped, so no test target is in a
  train window's input and a test window overlaps train targets in at most one character.

Departures: the text has no play titles (tiny Shakespeare), so a client is a role *name*
(whitespace runs collapsed), pooled over every play in which a role of that name speaks;
roles with fewer than ``min_chars`` samples are left out (LEAF's ``-k`` minimum).

Ids are LEAF's: the index in ``ALL_LETTERS`` (80 characters; ``"\\n"`` is 0, ``" "`` is 1), for
inputs and labels alike. No padding id is needed: every window is full. A character outside
``ALL_LETTERS`` becomes ``" "``, LEAF's unknown symbol (in tiny Shakespeare: one ``"$"``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from plfl.data.federated import ClientData, FederatedData
from plfl.errors import DataError

ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SEQ_LEN = 80  # LEAF's window length
TRAIN_FRACTION = 0.8  # LEAF's -tf 0.8, the FedAvg paper's split

_SPACE = ALL_LETTERS.index(" ")
_ASCII_IDS = np.full(128, _SPACE, dtype=np.int64)  # code point -> id; characters outside ALL_LETTERS -> " "
_ASCII_IDS[[ord(c) for c in ALL_LETTERS]] = np.arange(len(ALL_LETTERS))


def load_shakespeare(root: Optional[str], min_chars: int) -> FederatedData:
    """Clients = speaking roles of a play text, samples = next-character windows (LEAF's task).

    Args:
        root: ``data.root``, the text file, or a directory holding ``input.txt``; speeches are
            headed by the speaker's name alone on a line ending in ``:``, with a blank line
            between speeches (tiny Shakespeare's layout). min_chars: ``data.min_chars``, a role needs at
            least this many characters (= samples, newlines included) to become a client.

    Returns:
        One client per role in order of first appearance: ``x`` int64 ``(n, 80)`` character ids,
        ``y`` int64 ``(n,)`` the id of the next character; ``num_classes = vocab_size = 80``.

    Raises:
        DataError: ``root`` unset or missing, the file not UTF-8, empty, without speaker
            headings, a speech without a heading (with its line), or no role with
            ``min_chars`` characters.
    """
    path = _text_path(root)
    roles = _roles(path)
    chars = {name: sum(map(len, lines)) for name, lines in roles.items()}
    clients = [_client(roles[name]) for name in roles if chars[name] >= min_chars]
    if not clients:
        longest = max(chars, key=chars.get)
        raise DataError(
            f"No role in {path} has data.min_chars={min_chars} characters; the longest, {longest!r}, has "
            f"{chars[longest]}. Lower data.min_chars (at least 400) or use a longer text."
        )
    return FederatedData(
        f"shakespeare:{path.name}",
        clients,
        num_classes=len(ALL_LETTERS),
        input_shape=(SEQ_LEN,),
        vocab_size=len(ALL_LETTERS),
    )


def _text_path(root: str | None) -> Path:
    fix = "Set data.root to a play text such as tiny Shakespeare's input.txt, or to the directory holding it."
    if root is None:
        raise DataError(f"data.source=shakespeare needs data.root. {fix}")
    path = Path(root)
    if path.is_dir():
        path = path / "input.txt"
    if not path.is_file():
        raise DataError(f"Play text {path} does not exist. {fix}")
    return path


def _roles(path: Path) -> dict[str, list[str]]:
    """Each role's lines in text order, each closed by a newline (the lines of LEAF's per-role file)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e}). Convert it to UTF-8.") from None
    lines = text.split("\n")
    heading = "the speaker's name alone on a line ending in ':' (e.g. 'ROMEO:'), after a blank line"
    if not text.strip():
        raise DataError(f"{path} is empty. Point data.root at a play text whose speeches are headed by {heading}.")
    if not any(line.rstrip().endswith(":") for line in lines):
        raise DataError(
            f"{path} has no speaker headings. data.source=shakespeare needs a play text whose speeches "
            f"are headed by {heading}, as in tiny Shakespeare."
        )
    roles: dict[str, list[str]] = {}
    speaker = None  # None: the next non-blank line must be a heading
    for number, line in enumerate(lines, 1):
        if not line.strip():
            speaker = None
        elif speaker is not None:
            roles[speaker].append(re.sub(" {2,}", " ", line) + "\n")
        elif line.rstrip().endswith(":") and line.rstrip()[:-1].strip():
            speaker = " ".join(line.rstrip()[:-1].split())
            roles.setdefault(speaker, [])
        else:
            raise DataError(
                f"{path}, line {number}: {line[:60]!r} opens a speech without a speaker heading. Each "
                f"speech must start with {heading}: add the heading or join the line to the speech "
                "above it."
            )
    return roles


def _client(lines: list[str]) -> ClientData:
    """LEAF's samples of one role's lines (each closed by a newline), split in text order."""
    # [80 spaces, line] for every line; each non-padding position is a target, its window the 80 ids before it.
    codes = np.frombuffer("".join(" " * SEQ_LEN + line for line in lines).encode("utf-32-le"), np.uint32)
    ids = np.where(codes < 128, _ASCII_IDS[np.minimum(codes, 127)], _SPACE)
    is_target = np.concatenate([np.arange(SEQ_LEN + len(line)) >= SEQ_LEN for line in lines])
    targets = np.flatnonzero(is_target)
    windows = np.lib.stride_tricks.sliding_window_view(ids, SEQ_LEN)
    x, y = torch.from_numpy(windows[targets - SEQ_LEN]), torch.from_numpy(ids[targets])
    n_train = int(TRAIN_FRACTION * len(y))
    test_start = n_train + SEQ_LEN - 1
    return ClientData(x[:n_train], y[:n_train], x[test_start:], y[test_start:])
