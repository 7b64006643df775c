"""LEAF's JSON data (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018, arXiv:1812.01097).

LEAF writes each split as JSON files with ``users`` (user ids), ``num_samples``
(one count per user) and ``user_data[user] = {"x": [...], "y": [...]}``. Every
user is one client with the train and test samples the files give it; nothing
is re-partitioned. Clients are ordered by user id, as LEAF's own
``model_utils.read_data`` sorts them.

Image-valued ``x`` (FEMNIST: 784 floats per row, a row-major 28×28 grey image,
**1.0 = white background, ink dark**, the reverse of MNIST) is kept as LEAF
stores it: LEAF's FEMNIST CNN reads the values unchanged, without rescaling.
Text-valued ``x`` (Sent140: each row LEAF's tweet record ``[id, date, query,
user, text]``, or a plain string per sample) becomes token ids with the word
tokenizer AG News uses (:mod:`plfl.data.text`), its vocabulary trained on the
training texts of all users. LEAF's Shakespeare files (80-character strings
labelled by a character) are refused: ``data.source=shakespeare`` builds that
task from the play text.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from plfl.data.federated import ClientData, FederatedData
from plfl.data.text import encode, train_tokenizer
from plfl.errors import DataError

REGENERATE = "Regenerate the files with LEAF's preprocess.sh or restore the originals."


def load_leaf(
    root: Optional[str],
    image_shape: Optional[list[int]],
    num_classes: Optional[int],
    vocab_size: int,
    max_length: int,
    num_clients: Optional[int],
) -> FederatedData:
    """Read a LEAF data directory: one client per user, with the files' own train/test split.

    Files: ``<data.root>/train/*.json`` and ``<data.root>/test/*.json`` (LEAF's
    layout, all files of a folder merged), or ``<data.root>/train.json`` and
    ``<data.root>/test.json``. A user must appear in both splits with at least
    one sample in each, as LEAF's sample-based split (``-t sample``) produces;
    a user-based split (``-t user``) gives train and test to different users
    and is refused.

    Returns:
        ``FederatedData`` with ``x_*`` float32 ``(n, *data.image_shape)`` holding
        LEAF's values unchanged (FEMNIST: [0, 1], 1.0 = white background), or
        for text int64 token ids ``(n, data.max_length)`` (0 = padding) from a
        vocabulary of at most ``data.vocab_size`` ids trained on the train
        split's texts (``vocab_size`` set), and ``y_*`` int64 ``(n,)``; ``num_classes`` is ``data.num_classes`` or else
        the largest label of both splits + 1 (62 for FEMNIST when every class
        occurs).

    Raises:
        DataError: ``data.root`` is unset, a split's folder or file is missing
            or ambiguous, or a folder holds no ``.json``; a file is not valid
            JSON (with its line) or lacks ``users``/``num_samples``/``user_data``;
            a user is listed without ``user_data`` (or the reverse) or appears
            twice in a split; ``num_samples`` disagrees with the rows; ``x`` is
            images and has rows of another length than
            ``data.image_shape`` gives, or ``data.image_shape`` is unset; text rows
            are neither strings nor records ending in one, or text comes with
            ``data.image_shape`` set; ``y``
            holds something other than integers >= 0; a user is missing from
            one split or has no samples in it; ``data.num_clients`` or
            ``data.num_classes`` disagree with the files.
    """
    if root is None:
        raise DataError(
            "data.source=leaf needs data.root: the directory that holds LEAF's train/ and test/ "
            "folders (or train.json and test.json). Set data.root=<dir>."
        )
    root = Path(root)
    shape = None if image_shape is None else tuple(image_shape)
    splits = {split: _read_split(_split_files(root, split), shape) for split in ("train", "test")}
    train, test = splits["train"], splits["test"]
    if not train:
        raise DataError(
            f"The LEAF train files under {root} list no users. Point data.root at a LEAF data directory "
            f"with samples. {REGENERATE}"
        )
    for have, other in (("train", "test"), ("test", "train")):
        missing = sorted(splits[have].keys() - splits[other].keys())
        if missing:
            raise DataError(
                f"User {missing[0]!r} is in {splits[have][missing[0]][2]} but in no {other} file under {root} "
                f"({len(missing)} such users). Every client needs its own train and test samples: use files from "
                "one LEAF run with a sample-based split (preprocess.sh -t sample), which puts every user in both."
            )
    for split, by_user in splits.items():
        empty = next((user for user in sorted(by_user) if len(by_user[user][1]) == 0), None)
        if empty is not None:
            raise DataError(
                f"User {empty!r} has no {split} samples in {by_user[empty][2]}. Every client needs at "
                f"least one: remove the user from both splits or regenerate the files. {REGENERATE}"
            )
    if num_clients is not None and num_clients != len(train):
        raise DataError(
            f"data.num_clients={num_clients} but the LEAF files under {root} hold {len(train)} "
            "users, one client each. Remove data.num_clients or set it to that value."
        )

    users = sorted(train)
    top, path, user = max((int(s[u][1].max()), str(s[u][2]), u) for s in (train, test) for u in users)
    num_classes = top + 1 if num_classes is None else num_classes
    if top >= num_classes:
        raise DataError(
            f"{path}, user {user!r} holds label {top}, but data.num_classes={num_classes} allows "
            f"0..{num_classes - 1}. Raise data.num_classes or remove it to count the classes from the "
            "labels."
        )
    x_train, x_test, vocab_size = _inputs(splits, users, vocab_size, max_length)
    clients = [
        ClientData(x_train[u], torch.from_numpy(train[u][1]), x_test[u], torch.from_numpy(test[u][1])) for u in users
    ]
    return FederatedData(f"leaf:{root.name}", clients, num_classes, tuple(x_train[users[0]].shape[1:]), vocab_size)


def _inputs(splits: dict, users: list[str], vocab_size: int, max_length: int) -> tuple[dict, dict, Optional[int]]:
    """Each user's train and test ``x`` as tensors, and the vocabulary's size for text (None for images).

    Texts become ``data.max_length`` token ids from a vocabulary trained on every user's training texts, in
    user order, so no test text enters it.
    """
    if splits["train"][users[0]][0].dtype != object:  # images (a user of the other kind failed when read)
        x_train, x_test = ({user: torch.from_numpy(s[user][0]) for user in users} for s in splits.values())
        return x_train, x_test, None
    tokenizer = train_tokenizer(np.concatenate([splits["train"][user][0] for user in users]), vocab_size)
    x_train, x_test = ({user: encode(tokenizer, s[user][0], max_length) for user in users} for s in splits.values())
    return x_train, x_test, tokenizer.get_vocab_size()


def _split_files(root: Path, split: str) -> list[Path]:
    """The JSON files of one split: every ``*.json`` of ``root/split/``, or ``root/split.json``."""
    folder, file = root / split, root / f"{split}.json"
    if folder.is_dir() and file.is_file():
        raise DataError(
            f"{root} holds both {folder}/ and {file}. Keep one layout for the {split} split: "
            "LEAF's folder of .json files or a single file."
        )
    if file.is_file():
        return [file]
    if not folder.is_dir():
        raise DataError(
            f"Neither {folder}/ (LEAF's layout: one or more .json files) nor {file} exists. Point "
            "data.root at the directory LEAF's preprocess.sh filled (data/<name>/data) or restore the "
            "files."
        )
    files = sorted(folder.glob("*.json"))
    if not files:
        raise DataError(
            f"{folder} holds no .json files. LEAF writes the {split} split there as "
            f"all_data_*_{split}_*.json: copy them in or point data.root at the right directory."
        )
    return files


def _read_split(files: list[Path], shape: Optional[tuple[int, ...]]) -> dict[str, tuple[np.ndarray, np.ndarray, Path]]:
    """``user -> (x, y, file)`` over all ``files`` of one split."""
    users: dict[str, tuple[np.ndarray, np.ndarray, Path]] = {}
    for path in files:
        for user, x, y in _read_file(path, shape):
            if user in users:
                raise DataError(
                    f"User {user!r} appears in both {users[user][2]} and {path}. A user's samples of "
                    f"one split come from one file: remove the duplicate. {REGENERATE}"
                )
            users[user] = (x, y, path)
    return users


def _read_file(path: Path, shape: Optional[tuple[int, ...]]):
    """Yield ``(user, x, y)`` of one LEAF file, converting each user's lists and dropping them at once."""
    try:
        with path.open("rb") as f:
            # Pixels repeat (FEMNIST has at most 256 grey levels): one float object per distinct value, not per
            # pixel, keeps the parsed file 3x smaller (76 vs 237 MB for the shared subset's train.json).
            data = json.load(f, parse_float=functools.lru_cache(maxsize=None)(float))
    except json.JSONDecodeError as e:
        where = f"line {e.lineno}, column {e.colno}"
        raise DataError(f"{path} is not valid JSON ({where}: {e.msg}). {REGENERATE}") from None
    except (UnicodeDecodeError, OSError) as e:
        raise DataError(f"{path} cannot be read as JSON text ({type(e).__name__}: {e}). {REGENERATE}") from None
    keys = ("users", "num_samples", "user_data")
    if not (
        isinstance(data, dict)
        and isinstance(data.get("users"), list)
        and isinstance(data.get("num_samples"), list)
        and isinstance(data.get("user_data"), dict)
    ):
        found = f"keys {sorted(data)}" if isinstance(data, dict) else f"a JSON {type(data).__name__}"
        raise DataError(
            f"{path} holds {found}; a LEAF file is an object with the lists 'users' and 'num_samples' "
            f"and the object 'user_data' ({', '.join(keys)}). {REGENERATE}"
        )
    users, counts, user_data = data["users"], data["num_samples"], data["user_data"]
    if len(users) != len(counts):
        raise DataError(
            f"{path} lists {len(users)} users but {len(counts)} entries in 'num_samples'; LEAF writes "
            f"one count per user. {REGENERATE}"
        )
    unlisted = sorted(map(str, user_data.keys() - set(users)))
    if unlisted:
        raise DataError(f"{path} has user_data for {unlisted[0]!r}, which 'users' does not list. {REGENERATE}")
    for user, count in zip(users, counts):
        record = user_data.pop(user, None)
        if not (isinstance(record, dict) and isinstance(record.get("x"), list) and isinstance(record.get("y"), list)):
            what = "no entry" if record is None else "an entry without the lists 'x' and 'y'"
            raise DataError(
                f"{path} lists user {user!r} in 'users' but has {what} in 'user_data'; LEAF writes "
                f'user_data[user] = {{"x": [...], "y": [...]}}. {REGENERATE}'
            )
        where = f"{path}, user {user!r}"
        if not (len(record["x"]) == len(record["y"]) == count):
            raise DataError(
                f"{where}: 'num_samples' says {count} samples but 'x' has {len(record['x'])} rows and "
                f"'y' {len(record['y'])} labels; all three must agree. {REGENERATE}"
            )
        yield user, _inputs_of(record["x"], shape, where), _labels(record["y"], where)


def _inputs_of(rows: list, shape: Optional[tuple[int, ...]], where: str) -> np.ndarray:
    """One user's ``x``: a 1-D object array of texts, or float32 images ``(n, *shape)``."""
    first = rows[0] if rows else None
    if isinstance(first, str) or (isinstance(first, list) and any(isinstance(v, str) for v in first)):
        return _texts(rows, shape, where)
    return _images(rows, shape, where)


def _texts(rows: list, shape: Optional[tuple[int, ...]], where: str) -> np.ndarray:
    """The text of each row: the row itself, or the last field of LEAF's Sent140 record
    ``[id, date, query, user, text]``."""
    if shape is not None:
        raise DataError(
            f"{where}: 'x' holds text, but data.image_shape={list(shape)} is set, which only image "
            "data read. Remove data.image_shape."
        )
    texts = [row[-1] if isinstance(row, list) and row else row for row in rows]
    bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
    if bad is not None:
        raise DataError(
            f"{where}: row {bad} of 'x' is {json.dumps(rows[bad])[:80]}; text rows are strings or "
            f"LEAF's Sent140 records [id, date, query, user, text]. {REGENERATE}"
        )
    return np.array(texts, dtype=object)


def _images(rows: list, shape: Optional[tuple[int, ...]], where: str) -> np.ndarray:
    """float32 ``(n, *shape)`` from LEAF's flat rows of numbers."""
    if not rows:
        return np.empty((0, *(shape or (0,))), np.float32)
    first = rows[0] if isinstance(rows[0], list) else [rows[0]]
    length = math.prod(shape) if shape is not None else len(first)
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, list) or len(row) != length), None)
    if bad is not None:
        got = f"{len(rows[bad])} values" if isinstance(rows[bad], list) else f"a {type(rows[bad]).__name__}"
        need = f"data.image_shape={list(shape)} needs {length}" if shape else f"row 0 has {length}"
        raise DataError(
            f"{where}: row {bad} of 'x' has {got}, but {need}. Every row is one flattened image: fix "
            f"data.image_shape to the rows' image shape or regenerate the files."
        )
    try:
        x = np.array(rows)  # float64 for one user at a time; stored as float32 below
    except ValueError:  # lists nested inside the rows
        x = np.array([], dtype=object)
    if x.dtype.kind not in "fiu" or x.ndim != 2:
        raise DataError(
            f"{where}: 'x' is not a list of rows of numbers (it reads as a {x.dtype} array of shape "
            f"{x.shape}); LEAF's image data hold one flat row of pixel values per sample. {REGENERATE}"
        )
    if shape is None:
        raise DataError(
            f"data.image_shape is not set, and {where} holds images as rows of {length} values. Set it "
            f"to their shape (C, H, W), e.g. data.image_shape=[1,28,28] for FEMNIST's 784."
        )
    return x.astype(np.float32).reshape(-1, *shape)


def _labels(values: list, where: str) -> np.ndarray:
    """int64 ``(n,)`` class indices from LEAF's ``y``."""
    if not values:
        return np.empty(0, np.int64)
    try:
        y = np.array(values)
    except (ValueError, OverflowError):
        y = np.array([], dtype=object)
    if y.dtype.kind not in "iu" or y.ndim != 1 or (y < 0).any():
        bad = next((v for v in values if type(v) is not int or not 0 <= v < 2**63), None)
        shakespeare = " (characters, as in LEAF's Shakespeare: use data.source=shakespeare on the play text)"
        raise DataError(
            f"{where}: 'y' holds {json.dumps(bad)}; LEAF's labels are integer class indices >= 0 "
            f"(FEMNIST: 0-61, Sent140: 0-1){shakespeare if isinstance(bad, str) else ''}. {REGENERATE}"
        )
    return y.astype(np.int64)
