"""AG News (Zhang, Zhao & LeCun, "Character-level Convolutional Networks for Text Classification",
NeurIPS 2015) from its original CSV files.

Each file has no header and one RFC 4180 record per news item: ``"class","title","description"`` with
class 1-4 (World, Sports, Business, Sci/Tech, the lines of ``classes.txt``). The train and test files are
pooled, as PFLlib's ``generate_AGNews.py`` (FedALA's data) pools torchtext's two AG_NEWS splits before
partitioning; plfl then partitions the pool and splits each client into train and test.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from plfl.errors import DataError

NUM_CLASSES = 4
_LAYOUT = 'rows "class","title","description" without a header, class 1-4'


def read_agnews(root: Optional[str], train_file: str, test_file: str) -> tuple[np.ndarray, torch.Tensor, int]:
    """The rows of ``train_file`` then ``test_file`` (``data.train_file``, ``data.test_file``) under ``root``
    (``data.root``), pooled.

    Returns:
        The texts, ``title + " " + description``, as a NumPy object array of ``str`` ``(n,)``; the labels int64
        ``(n,)``, class - 1 (0 World, 1 Sports, 2 Business, 3 Sci/Tech); the class count, 4.

    Raises:
        DataError: ``data.root`` is unset; a file is missing, unreadable, not UTF-8 or empty; a record is
            malformed CSV or has other than 3 fields (the line is named); a class is not 1-4.
    """
    if root is None:
        raise DataError(
            "data.source=agnews needs data.root: the directory that holds the AG News "
            f"{train_file} and {test_file}. Set data.root=<dir>."
        )
    texts, labels = [], []
    for name, key in ((train_file, "train_file"), (test_file, "test_file")):
        rows = _read_rows(Path(root) / name, key)
        texts += [f"{title} {description}" for _, title, description in rows]
        labels += [label for label, _, _ in rows]
    return np.array(texts, dtype=object), torch.tensor(labels, dtype=torch.int64), NUM_CLASSES


def _read_rows(path: Path, key: str) -> list[tuple[int, str, str]]:
    """(label 0-3, title, description) of every record of one AG News CSV file."""
    fix = f"Restore the official AG News CSV ({_LAYOUT}) or point data.{key} at it."
    if not path.is_file():
        raise DataError(
            f"AG News file {path} does not exist. Place the official {path.name} there, or set "
            f"data.root and data.{key} to the file's directory and name."
        )
    rows = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f, strict=True)
            try:
                for record in reader:
                    rows.append(_parse(record, path, reader.line_num, fix))
            except csv.Error as e:
                raise DataError(f"{path}, line {reader.line_num}: malformed CSV ({e}). {fix}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}). {fix}") from None
    except OSError as e:
        raise DataError(f"Could not read {path} ({e.strerror}). Check the file's permissions.") from None
    if not rows:
        raise DataError(f"{path} holds no records. {fix}")
    return rows


def _parse(record: list[str], path: Path, line: int, fix: str) -> tuple[int, str, str]:
    if len(record) != 3:
        raise DataError(f"{path}, line {line}: {len(record)} fields, expected 3 (class, title, description). {fix}")
    label, title, description = record
    if label not in ("1", "2", "3", "4"):
        raise DataError(
            f"{path}, line {line}: class {label!r} is not one of 1, 2, 3, 4 (World, Sports, Business, Sci/Tech). {fix}"
        )
    return int(label) - 1, title, description
