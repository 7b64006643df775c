"""A SuperNode's own data set: its clients' splits as files on the node's disk.

``plfl flower split`` writes a config's federation for P SuperNodes, one directory per node: ``node-K/`` holds
``client-<id>.npz`` for each of its clients (K, K + P, ...), with the arrays ``x_train``, ``y_train``, ``x_test``,
``y_test``, ``x_val`` and ``y_val`` as plfl trains on them (normalised, partitioned and split), and
``federation.json`` (the data set's ``name``, ``num_clients``, ``num_classes``, ``input_shape``, ``vocab_size`` and
the node's ``clients``). A SuperNode started with ``--node-config "data-dir=.../node-K"`` reads these files and no
others. They are plain ``.npz`` arrays, read without pickle: a crafted file cannot run code.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import torch

from plfl.data.federated import ClientData, FederatedData
from plfl.errors import DataError

ARRAYS = ("x_train", "y_train", "x_test", "y_test", "x_val", "y_val")
DESCRIPTION = "federation.json"


def write_node_data(data: FederatedData, nodes: int, output: Path) -> list[Path]:
    """Write ``data`` split over ``nodes`` SuperNodes under ``output``; returns the nodes' directories.

    Raises:
        ValueError: ``nodes`` is below 1 or above the number of clients.
    """
    if not 1 <= nodes <= len(data.clients):
        raise ValueError(f"{nodes} nodes for {len(data.clients)} clients: give each node at least one client")
    directories = []
    for node in range(nodes):
        directory = output / f"node-{node}"
        directory.mkdir(parents=True, exist_ok=True)
        clients = list(range(node, len(data.clients), nodes))
        for client in clients:
            c = data.clients[client]
            np.savez(directory / f"client-{client}.npz", **{name: getattr(c, name).numpy() for name in ARRAYS})
        description = {
            "name": data.name,
            "num_clients": len(data.clients),
            "num_classes": data.num_classes,
            "input_shape": list(data.input_shape),
            "vocab_size": data.vocab_size,
            "clients": clients,
        }
        (directory / DESCRIPTION).write_text(json.dumps(description, indent=1) + "\n")
        directories.append(directory)
    return directories


def read_node_data(directory: Path) -> tuple[FederatedData, list[int]]:
    """The federation as a node holding ``directory`` sees it: its own clients' data, every other client with 0
    samples; and its clients' ids.

    Raises:
        DataError: ``federation.json`` or a client file is missing, unreadable, or holds arrays of the wrong
            dtype, shape or labels; the message names the file.
    """
    path = directory / DESCRIPTION
    try:
        description = json.loads(path.read_text())
        name, num_clients, num_classes = description["name"], description["num_clients"], description["num_classes"]
        shape, vocab, clients = tuple(description["input_shape"]), description["vocab_size"], description["clients"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(
            f"{path} cannot be read as a SuperNode's data description ({type(error).__name__}: {error}). Write the "
            "node's data again with plfl flower split."
        ) from None
    dtype = torch.float32 if vocab is None else torch.int64
    empty = ClientData(
        torch.empty((0, *shape), dtype=dtype),
        torch.empty(0, dtype=torch.int64),
        torch.empty((0, *shape), dtype=dtype),
        torch.empty(0, dtype=torch.int64),
    )
    federation = [empty] * num_clients
    for client in clients:
        federation[client] = read_client(directory / f"client-{client}.npz", shape, dtype, num_classes)
    return FederatedData(name, federation, num_classes, shape, vocab), clients


def read_client(path: Path, shape: tuple[int, ...], dtype: torch.dtype, num_classes: int) -> ClientData:
    """One client's splits from ``path``, checked against the data set's ``shape``, ``dtype`` and classes.

    Raises:
        DataError: the file is missing or corrupt, pickles objects, lacks an array, or holds one of another dtype
            or shape, or a label outside 0..num_classes − 1.
    """
    fix = "Write the node's data again with plfl flower split."
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in ARRAYS}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
        raise DataError(f"{path} cannot be read as a client's data ({type(error).__name__}: {error}). {fix}") from None
    tensors = {}
    for split in ("train", "test", "val"):
        x, y = torch.from_numpy(arrays[f"x_{split}"]), torch.from_numpy(arrays[f"y_{split}"])
        if x.dtype != dtype or tuple(x.shape[1:]) != shape or y.dtype != torch.int64 or y.shape != (len(x),):
            raise DataError(
                f"{path}: x_{split} is {x.dtype} {tuple(x.shape)} and y_{split} {y.dtype} {tuple(y.shape)}; the data "
                f"set holds {dtype} samples of shape {shape} with one int64 label each. {fix}"
            )
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise DataError(f"{path}: y_{split} holds a label outside 0..{num_classes - 1}. {fix}")
        tensors[split] = x, y
    return ClientData(*tensors["train"], *tensors["test"], *tensors["val"])
