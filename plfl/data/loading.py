"""The one entry point from a ``data.*`` section to the clients' tensors: :func:`load_federated_data`."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from plfl.data.federated import ClientData, FederatedData
from plfl.data.partition import Flower, partitions, split_train_test, split_train_val
from plfl.data.sources import DEFAULT_NUM_CLIENTS, data_sources
from plfl.errors import DataError
from plfl.seeding import derive_seed


def load_federated_data(cfg: Any, seed: int) -> FederatedData:
    """Load ``cfg.source`` (``cfg``: a validated ``data.*`` section, :data:`plfl.data.sources.DataConfig`) and
    split it over clients.

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

    With ``cfg.val_fraction`` > 0 every client's training split, whichever the
    source, is then split once more (:func:`hold_out_validation`); at 0 the
    clients are exactly those without the key. With ``cfg.rotation_groups`` > 1
    the clients' images are then rotated by group (:func:`rotated`), or, with
    ``cfg.rotation_mixture``, each sample by a group drawn from its client's
    own mixture of the rotations (:func:`rotation_mixed`).

    Raises:
        DataError: files are missing, corrupt, unsafe or inconsistent, or the
            partition is impossible with the given settings; the message names
            the file or key to fix; ``cfg.rotation_mixture`` without
            rotation groups to mix.
    """
    if cfg.rotation_mixture is not None and cfg.rotation_groups <= 1:
        raise DataError(
            f"data.rotation_mixture={cfg.rotation_mixture} mixes rotation groups, but data.rotation_groups is "
            f"{cfg.rotation_groups}. Set data.rotation_groups to the number of rotations (> 1), or remove "
            "data.rotation_mixture."
        )
    data = _clients(cfg, seed)
    data = hold_out_validation(data, cfg.val_fraction, seed) if cfg.val_fraction else data
    if cfg.rotation_groups <= 1:
        return data
    if cfg.rotation_mixture is not None:
        return rotation_mixed(data, cfg.rotation_groups, cfg.rotation_mixture, seed)
    return rotated(data, cfg.rotation_groups)


def rotated(data: FederatedData, groups: int) -> FederatedData:
    """``data`` with client i's images rotated counter-clockwise by (i mod ``groups``) · 360°/``groups``
    (torchvision's ``rotate``, nearest pixels, zeros outside; quarter turns are exact): the clusters of IFCA's
    rotated MNIST (Ghosh et al., NeurIPS 2020), whose ground truth is i mod ``groups``.

    Raises:
        DataError: the samples are not images (C, H, W).
    """
    _require_images(data, groups)
    clients = []
    for i, c in enumerate(data.clients):
        angle = (i % groups) * 360.0 / groups
        x_train, x_test, x_val = (_rotate(x, angle) for x in (c.x_train, c.x_test, c.x_val))
        clients.append(ClientData(x_train, c.y_train, x_test, c.y_test, x_val, c.y_val))
    return dataclasses.replace(data, clients=clients)


def rotation_mixture(client_id: int, groups: int, alpha: float, seed: int) -> tuple[np.ndarray, np.random.Generator]:
    """Client ``client_id``'s proportions of the ``groups`` rotations, (groups,) float64 ~ Dir(``alpha``, ...,
    ``alpha``), and the generator (seeded from the stream ``"rotation_mixture"`` of ``seed`` and the client) that
    then draws its samples' groups: the ground truth of :func:`rotation_mixed`."""
    rng = np.random.default_rng(derive_seed(seed, 0, client_id, "rotation_mixture"))
    return rng.dirichlet(np.full(groups, alpha)), rng


def rotation_groups_of(data: FederatedData, groups: int, alpha: float, seed: int) -> list[tuple[np.ndarray, ...]]:
    """Per client, its proportions (groups,) and its training, test and validation samples' groups (int64 arrays
    in the splits' order), as :func:`rotation_mixed` draws them."""
    drawn = []
    for i, c in enumerate(data.clients):
        proportions, rng = rotation_mixture(i, groups, alpha, seed)
        splits = [rng.choice(groups, size=len(y), p=proportions) for y in (c.y_train, c.y_test, c.y_val)]
        drawn.append((proportions, *splits))
    return drawn


def rotation_mixed(data: FederatedData, groups: int, alpha: float, seed: int) -> FederatedData:
    """``data`` with every image rotated counter-clockwise by g · 360°/``groups``, its group g drawn from its
    client's own proportions (:func:`rotation_mixture`, Dirichlet ``alpha``), independently per sample of the
    training, test and validation splits (:func:`rotation_groups_of`): planted mixtures of rotated copies, whose
    components are the rotations and whose per-client weights are the proportions (FedEM's setting, Marfoq et al.,
    NeurIPS 2021).

    Raises:
        DataError: the samples are not images (C, H, W).
    """
    _require_images(data, groups)
    clients = []
    for c, (_, *drawn) in zip(data.clients, rotation_groups_of(data, groups, alpha, seed)):
        turned = []
        for x, group in zip((c.x_train, c.x_test, c.x_val), drawn):
            x = x.clone()
            for g in range(1, groups):
                index = torch.from_numpy(np.flatnonzero(group == g))
                if len(index):
                    x[index] = _rotate(x[index], g * 360.0 / groups)
            turned.append(x)
        clients.append(ClientData(turned[0], c.y_train, turned[1], c.y_test, turned[2], c.y_val))
    return dataclasses.replace(data, clients=clients)


def _require_images(data: FederatedData, groups: int) -> None:
    if data.vocab_size is not None or len(data.input_shape) != 3:
        raise DataError(
            f"data.rotation_groups={groups} rotates images; {data.name}'s samples have shape {data.input_shape}. "
            "Set data.rotation_groups=1."
        )


def _rotate(images: torch.Tensor, angle: float) -> torch.Tensor:
    """``images`` (n, C, H, W) rotated counter-clockwise by ``angle`` degrees; unchanged at 0 or for n = 0."""
    from torchvision.transforms.v2.functional import rotate

    return rotate(images, angle) if angle and len(images) else images


def hold_out_validation(data: FederatedData, val_fraction: float, seed: int) -> FederatedData:
    """``data`` with each client's training split split into the samples it trains on and its validation split
    (:func:`~plfl.data.partition.split_train_val`: ``ceil(val_fraction · n)`` of its n training samples, at least
    one, stratified by label where possible), drawn from the seed of the stream ``"validation_hold_out"`` of
    ``seed`` and the client (:func:`plfl.seeding.derive_seed`), so that a client's split depends on neither the
    source nor the other clients. The test splits are untouched; both parts keep the training split's order.

    Raises:
        DataError: a client has fewer than 2 training samples (the message names the client).
    """
    clients = []
    for i, client in enumerate(data.clients):
        rng = np.random.default_rng(derive_seed(seed, 0, i, "validation_hold_out"))
        try:
            train, val = split_train_val(np.arange(client.num_train), client.y_train.numpy(), val_fraction, rng)
        except DataError as e:
            raise DataError(f"Client {i}: {e}") from None
        train, val = torch.from_numpy(train), torch.from_numpy(val)
        clients.append(
            ClientData(
                client.x_train[train],
                client.y_train[train],
                client.x_test,
                client.y_test,
                client.x_train[val],
                client.y_train[val],
            )
        )
    return dataclasses.replace(data, clients=clients)


def _clients(cfg: Any, seed: int) -> FederatedData:
    """The clients of ``cfg.source`` with their train and test splits (see :func:`load_federated_data`)."""
    source = data_sources()[cfg.source].of(cfg)
    read = source.read()
    columns = {}
    if isinstance(read, FederatedData):
        if not source.partitioned():
            return read
        x = torch.cat([t for c in read.clients for t in (c.x_train, c.x_test)])
        y = torch.cat([t for c in read.clients for t in (c.y_train, c.y_test)])
        name, num_classes = read.name, read.num_classes
    else:
        (x, y, num_classes, *more), name = read, cfg.source
        columns = more[0] if more else {}  # per-sample columns besides the labels (hf: e.g. FEMNIST's writer_id)

    labels = y.numpy()
    rng = np.random.default_rng(seed)
    partition = partitions()[cfg.partition].of(cfg)
    num_clients = DEFAULT_NUM_CLIENTS if cfg.num_clients is None else cfg.num_clients
    if isinstance(partition, Flower):  # its partitioners may split by a column, and may set the client count
        parts = partition.split(labels, num_clients, rng, columns=columns, num_clients_set=cfg.num_clients is not None)
    else:
        parts = partition.split(labels, num_clients, rng)

    splits = []
    for i, idx in enumerate(parts):
        try:
            splits.append(split_train_test(idx, labels, partition.test_fraction, rng))
        except DataError as e:
            raise DataError(f"Client {i} of the {cfg.partition} partition: {e}") from None
    vocab_size = None
    encoded = source.encode(x, np.concatenate([train for train, _ in splits]))
    if encoded is not None:
        x, vocab_size = encoded
    clients = []
    for train, test in splits:
        train, test = torch.from_numpy(train), torch.from_numpy(test)
        clients.append(ClientData(x[train], y[train], x[test], y[test]))
    return FederatedData(name, clients, num_classes, tuple(x.shape[1:]), vocab_size)
