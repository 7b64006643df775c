"""Data sources and the one entry point, :func:`load_federated_data`.

Every source ends as in-memory CPU tensors per client, built once. Pooled
sources (``digits``, the torchvision sets, ``imagefolder``, ``agnews``) are partitioned over
clients by ``data.partition``; ``pfllib`` directories already hold one file per client,
kept as they are unless ``data.repartition`` pools and partitions them too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import torch

from plfl.data.agnews import read_agnews
from plfl.data.federated import ClientData, FederatedData
from plfl.data.imagefolder import load_image_folder
from plfl.data.leaf import load_leaf
from plfl.data.partition import (
    classes_partition,
    dirichlet_partition,
    dominant_partition,
    iid_partition,
    pathological_partition,
    split_train_test,
)
from plfl.data.safe_npz import load_npz_dict
from plfl.data.shakespeare import load_shakespeare
from plfl.data.text import encode, train_tokenizer
from plfl.errors import DataError

if TYPE_CHECKING:
    from plfl.config import DataConfig

SIZES_KEY = "Size of samples for labels in clients"


def load_federated_data(cfg: DataConfig, seed: int) -> FederatedData:
    """Load ``cfg.source`` and split it over clients.

    Pooled sources are partitioned (``cfg.partition``, default 20 clients when
    ``cfg.num_clients`` is None) and each client split into train/test by
    ``cfg.test_fraction``; the same ``seed`` gives the same split. ``pfllib``
    takes clients and splits from its files, or with ``cfg.repartition`` pools
    every client's train and test samples and partitions them the same way.

    Images are float32 ``(C, H, W)``: ``digits`` in [0, 1], ``leaf`` as its
    files store them (FEMNIST: [0, 1], 1.0 = white background), ``imagefolder``
    normalised per channel over the pool (:func:`plfl.data.imagefolder.load_image_folder`),
    the others in [-1, 1] (``(x/255 - 0.5) / 0.5``, as PFLlib normalises).
    Texts (``agnews``) are int64 token ids ``(data.max_length,)``, 0 the padding,
    from a vocabulary trained on the clients' training texts only; the
    result's ``vocab_size`` is then set.

    Raises:
        DataError: files are missing, corrupt, unsafe or inconsistent, or the
            partition is impossible with the given settings; the message names
            the file or key to fix.
    """
    if cfg.source in CLIENT_SPLIT_READERS:
        files = CLIENT_SPLIT_READERS[cfg.source](cfg)
        if not cfg.repartition:
            return files
        x = torch.cat([t for c in files.clients for t in (c.x_train, c.x_test)])
        y = torch.cat([t for c in files.clients for t in (c.y_train, c.y_test)])
        name, num_classes = files.name, files.num_classes
    else:
        name, (x, y, num_classes) = cfg.source, POOLED_READERS[cfg.source](cfg)

    labels = y.numpy()
    num_clients = cfg.clients
    rng = np.random.default_rng(seed)
    parts = _partition(cfg, labels, num_clients, rng)

    splits = []
    for i, idx in enumerate(parts):
        try:
            splits.append(split_train_test(idx, labels, cfg.test_fraction, rng))
        except DataError as e:
            raise DataError(f"Client {i} of the {cfg.partition} partition: {e}") from None
    vocab_size = None
    if cfg.source in POOLED_ENCODERS:
        x, vocab_size = POOLED_ENCODERS[cfg.source](cfg, x, np.concatenate([train for train, _ in splits]))
    clients = []
    for train, test in splits:
        train, test = torch.from_numpy(train), torch.from_numpy(test)
        clients.append(ClientData(x[train], y[train], x[test], y[test]))
    return FederatedData(name, clients, num_classes, tuple(x.shape[1:]), vocab_size)


def _token_ids(cfg: DataConfig, texts: np.ndarray, train_index: np.ndarray) -> tuple[torch.Tensor, int]:
    """Every text as ``data.max_length`` token ids (:mod:`plfl.data.text`), and the vocabulary's size.

    The vocabulary (at most ``data.vocab_size`` ids) is trained on ``texts[train_index]``, the clients'
    training texts, so no test text enters it: it is built here, after the split, not by the reader.
    FedALA's data (PFLlib's ``generate_AGNews.py``) builds it from all texts, test texts included.
    """
    tokenizer = train_tokenizer(texts[train_index], cfg.vocab_size)
    return encode(tokenizer, texts, cfg.max_length), tokenizer.get_vocab_size()


def _partition(cfg: DataConfig, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Index arrays of ``cfg.partition`` over ``num_clients`` clients (see :mod:`plfl.data.partition`)."""
    if cfg.partition == "dirichlet":
        return dirichlet_partition(labels, num_clients, cfg.beta, cfg.min_samples, cfg.max_retries, rng)
    if cfg.partition == "pathological":
        return pathological_partition(labels, num_clients, cfg.classes_per_client, rng)
    if cfg.partition == "classes":
        return classes_partition(labels, num_clients, cfg.classes_per_client, rng)
    if cfg.partition == "dominant":
        return dominant_partition(labels, num_clients, cfg.dominant_classes, cfg.dominant_fraction, rng)
    return iid_partition(labels, num_clients, rng)


def _load_digits(cfg: DataConfig) -> tuple[torch.Tensor, torch.Tensor, int]:
    """scikit-learn's bundled 8x8 digits: 1,797 images ``(1, 8, 8)`` in [0, 1], 10 classes."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.from_numpy((digits.images / 16.0).astype(np.float32)).unsqueeze(1).contiguous()
    return x, torch.from_numpy(digits.target.astype(np.int64)), 10


# source -> (torchvision class name, number of classes, folder under root, what goes there)
_TORCHVISION = {
    "mnist": ("MNIST", 10, "MNIST/raw", "the four unzipped MNIST files (train-images-idx3-ubyte, ...)"),
    "fashionmnist": (
        "FashionMNIST",
        10,
        "FashionMNIST/raw",
        "the four unzipped Fashion-MNIST files (train-images-idx3-ubyte, ...)",
    ),
    "cifar10": ("CIFAR10", 10, "cifar-10-batches-py", "the contents of cifar-10-python.tar.gz"),
    "cifar100": ("CIFAR100", 100, "cifar-100-python", "the contents of cifar-100-python.tar.gz"),
}


def _load_torchvision(cfg: DataConfig) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The train and test sets of a torchvision data set, pooled (as PFLlib does).

    Returns ``x`` float32 ``(n, C, H, W)`` in [-1, 1], ``y`` int64 ``(n,)``, the class count.
    """
    import torchvision.datasets

    source, root, download = cfg.source, cfg.root, cfg.download

    cls_name, num_classes, folder, contents = _TORCHVISION[source]
    if root is None:
        raise DataError(
            f"data.source={source} needs data.root, the directory torchvision reads {cls_name} from "
            f"(files under <root>/{folder}). Set data.root=<directory>."
        )
    cls = getattr(torchvision.datasets, cls_name)
    try:
        splits = [cls(root, train=train, download=download) for train in (True, False)]
    except (RuntimeError, OSError) as e:
        where = Path(root) / folder
        fix = f"Place {contents} in {where}, or set data.download=true on a machine with internet access."
        if download:
            raise DataError(
                f"Could not download {cls_name} into {root} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                f"this machine may have no internet access. {fix}"
            ) from None
        raise DataError(f"The {cls_name} data set is not in {root} and data.download is false. {fix}") from None
    images = []
    for split in splits:
        data = torch.as_tensor(split.data)  # uint8: (n, H, W) for MNIST-like, (n, H, W, C) for CIFAR
        images.append(data.unsqueeze(1) if data.ndim == 3 else data.permute(0, 3, 1, 2))
    # cat of permuted CIFAR images keeps channels-last strides; the clients need contiguous (C, H, W).
    x = torch.cat(images).contiguous().float().div_(255).sub_(0.5).div_(0.5)
    y = torch.cat([torch.as_tensor(split.targets, dtype=torch.int64) for split in splits])
    return x, y, num_classes


def _load_pfllib(cfg: DataConfig) -> FederatedData:
    """A PFLlib data directory: ``config.json``, ``train/`` and ``test/`` with one file per client."""
    root, num_clients = cfg.root, None if cfg.repartition else cfg.num_clients
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


# Readers by ``data.source`` (:data:`SOURCES`, the names the config accepts). A pooled reader returns
# (x, y, number of classes) for the partitioner; a client-split reader returns the clients as its files
# define them. Each takes the DataConfig and raises DataError naming the file and the fix.
POOLED_READERS: dict[str, Callable[[DataConfig], tuple[Any, torch.Tensor, int]]] = {
    "digits": _load_digits,
    **{source: _load_torchvision for source in _TORCHVISION},
    "agnews": read_agnews,
    "imagefolder": lambda cfg: load_image_folder(cfg.root, cfg.cache_dir),
}
# Pooled sources whose raw samples (texts) become tensors only after the split, by an encoder fitted on the
# training samples alone: source -> encoder(cfg, samples, train_index) -> (x tensor, vocab_size).
POOLED_ENCODERS: dict[str, Callable[[DataConfig, Any, np.ndarray], tuple[torch.Tensor, int]]] = {
    "agnews": _token_ids,
}
CLIENT_SPLIT_READERS: dict[str, Callable[[DataConfig], FederatedData]] = {
    "pfllib": _load_pfllib,
    "shakespeare": load_shakespeare,
    "leaf": load_leaf,
}
SOURCES = (*POOLED_READERS, *CLIENT_SPLIT_READERS)  # every data.source name
