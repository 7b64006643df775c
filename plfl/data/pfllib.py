"""PFLlib's (and FedALA's) data directories: ``config.json``, ``train/`` and ``test/`` with one ``.npz`` file per
client, read without running pickled code (:mod:`plfl.data.safe_npz`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from plfl.data.federated import ClientData, FederatedData
from plfl.data.safe_npz import load_npz_dict
from plfl.errors import DataError

SIZES_KEY = "Size of samples for labels in clients"


def load_pfllib(root: Optional[str], num_clients: Optional[int]) -> FederatedData:
    """A PFLlib data directory ``root`` (``data.root``): ``config.json``, ``train/`` and ``test/`` with one file
    per client; ``num_clients``, when set, must be the files' number of clients.

    Raises:
        DataError: a file is missing, unreadable, unsafe or inconsistent with ``config.json`` (the message names
            it and the fix), or ``num_clients`` disagrees with it.
    """
    layout = "config.json, train/ and test/ (a PFLlib dataset/<name> folder)"
    if root is None:
        raise DataError(f"data.source=pfllib needs data.root: the directory that holds {layout}. Set data.root=<dir>.")
    root_dir = Path(root)
    if not root_dir.is_dir():
        raise DataError(
            f"PFLlib data directory {root_dir} does not exist. Set data.root to a directory holding {layout}."
        )
    config_path = root_dir / "config.json"
    meta = _read_pfllib_config(config_path)
    n_clients, n_classes = meta["num_clients"], meta["num_classes"]
    if num_clients is not None and num_clients != n_clients:
        raise DataError(
            f"data.num_clients={num_clients} but {config_path} says num_clients={n_clients}. A PFLlib data set "
            "fixes its clients: remove data.num_clients or set it to that value."
        )
    train_files = _client_files(root_dir, "train", n_clients)
    test_files = _client_files(root_dir, "test", n_clients)
    expected_sizes = meta.get(SIZES_KEY)
    if expected_sizes is not None and len(expected_sizes) != n_clients:
        raise DataError(
            f"{config_path} lists label counts for {len(expected_sizes)} clients under '{SIZES_KEY}' but says "
            f"num_clients={n_clients}. Regenerate the data set or fix config.json."
        )

    sample_shape: Optional[tuple[int, ...]] = None
    clients = []
    for i, (train_path, test_path) in enumerate(zip(train_files, test_files)):
        arrays = []
        for path in (train_path, test_path):
            x, y = _checked_arrays(load_npz_dict(path), path, n_classes)
            if sample_shape is None:
                sample_shape = x.shape[1:]
            elif x.shape[1:] != sample_shape:
                raise DataError(
                    f"{path} holds samples of shape {x.shape[1:]} but {train_files[0]} holds {sample_shape}. "
                    "All client files of one data set must share a sample shape: regenerate the data set."
                )
            arrays += [x, y]
        x_train, y_train, x_test, y_test = arrays
        if len(y_train) == 0:
            raise DataError(
                f"Client {i} has no training samples ({train_path} is empty). Every client needs at least "
                "one: regenerate the data set with PFLlib (e.g. with fewer clients)."
            )
        if expected_sizes is not None:
            _check_label_counts(i, expected_sizes[i], np.concatenate([y_train, y_test]), n_classes, config_path)
        clients.append(ClientData(*(torch.from_numpy(a) for a in arrays)))
    return FederatedData(f"pfllib:{root_dir.name}", clients, n_classes, tuple(sample_shape))


def _read_pfllib_config(path: Path) -> dict:
    if not path.is_file():
        raise DataError(
            f"{path} does not exist. A PFLlib data directory needs the config.json PFLlib writes next to "
            "train/ and test/: restore it or point data.root at the right directory."
        )
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}). Restore the config.json PFLlib wrote.") from None
    for key in ("num_clients", "num_classes"):
        if not isinstance(meta, dict) or not isinstance(meta.get(key), int) or meta[key] < 1:
            raise DataError(f"{path} has no positive integer '{key}'. Restore the config.json PFLlib wrote.")
    return meta


def _client_files(root: Path, split: str, num_clients: int) -> list[Path]:
    """Client files of ``root/split``, named ``{i}.npz`` (PFLlib) or ``{split}{i}_.npz`` (FedALA)."""
    folder = root / split
    if not folder.is_dir():
        raise DataError(f"{folder} does not exist. A PFLlib data directory holds {split}/ with one .npz per client.")
    found: dict[int, Path] = {}
    for path in sorted(folder.iterdir()):
        m = re.fullmatch(r"(\d+)\.npz", path.name) or re.fullmatch(rf"{split}(\d+)_\.npz", path.name)
        if not m:
            continue
        i = int(m[1])
        if i in found:
            raise DataError(
                f"{folder} holds both {found[i].name} and {path.name} for client {i}. Keep one naming "
                f"({{i}}.npz or {split}{{i}}_.npz) and remove the other files."
            )
        found[i] = path
    for i in range(num_clients):
        if i not in found:
            raise DataError(
                f"Client file {folder / f'{i}.npz'} (or {folder / f'{split}{i}_.npz'}) does not exist, while "
                f"{root / 'config.json'} says num_clients={num_clients}. Restore the file or regenerate the data set."
            )
    if len(found) != num_clients:
        raise DataError(
            f"{folder} holds {len(found)} client files but {root / 'config.json'} says "
            f"num_clients={num_clients}. The files and config.json must come from the same PFLlib run: "
            "regenerate the data set or fix config.json."
        )
    return [found[i] for i in range(num_clients)]


def _checked_arrays(data: dict, path: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """``x`` float32 ``(n, ...)`` and ``y`` int64 ``(n,)`` with labels in ``[0, num_classes)``."""
    x, y = data["x"], data["y"]
    if x.dtype != np.float32 or x.ndim < 2:
        raise DataError(
            f"{path}: 'x' is a {x.dtype} array of shape {x.shape}; plfl expects float32 samples (n, C, H, W). "
            "Regenerate the file with PFLlib."
        )
    if not np.issubdtype(y.dtype, np.integer) or y.shape != (len(x),):
        raise DataError(
            f"{path}: 'y' is a {y.dtype} array of shape {y.shape}; plfl expects {len(x)} integer labels to match "
            "'x'. Regenerate the file with PFLlib."
        )
    bad = y[(y < 0) | (y >= num_classes)]
    if len(bad):
        raise DataError(
            f"{path} holds label {bad[0]}, outside 0..{num_classes - 1} (config.json says "
            f"num_classes={num_classes}). Fix num_classes in config.json or regenerate the data set."
        )
    return np.ascontiguousarray(x), np.ascontiguousarray(y, dtype=np.int64)


def _check_label_counts(client: int, expected: list, labels: np.ndarray, num_classes: int, config_path: Path) -> None:
    """Compare a client's train+test label counts with config.json's ``[[label, count], ...]``."""
    want = np.zeros(num_classes, dtype=np.int64)
    for entry in expected:
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in range(num_classes)):
            raise DataError(
                f"{config_path}: '{SIZES_KEY}' of client {client} has the entry {entry!r}; expected "
                f"[label, count] with a label in 0..{num_classes - 1}. Restore the config.json PFLlib wrote."
            )
        want[entry[0]] = entry[1]
    have = np.bincount(labels, minlength=num_classes)
    mismatched = np.flatnonzero(want != have)
    if len(mismatched):
        label = mismatched[0]
        raise DataError(
            f"Client {client} holds {have[label]} samples of label {label} (train + test), but {config_path} "
            f"says {want[label]} under '{SIZES_KEY}'. The files and config.json come from different PFLlib runs: "
            "regenerate the data set or restore the matching config.json."
        )
