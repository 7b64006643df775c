"""The data sources ``data.source`` names, each with the keys it reads, and the ``data.*`` section they make up.

A source is a :class:`DataSource`: a dataclass of its keys, its name, and :meth:`DataSource.read`, which calls
its reader (imported then: the readers pull in torch, torchvision, PIL, tokenizers, which checking a config
does without). Pooled sources (``digits``, the torchvision sets, ``imagefolder``, ``agnews``, ``hf``) are split
over clients by a :class:`~plfl.data.partition.Partition`; ``pfllib`` directories, LEAF files and the Shakespeare
text hold their own clients (``pfllib`` and ``leaf``'s images pool and re-partition them with ``data.repartition``).
:data:`DataConfig` is the ``data.*`` section: every source's and every partition's keys, of which a run's config
sets only those its source and partition read (:mod:`plfl.config` checks that). A new source is a subclass here
with its reader beside it (the data sources' guide).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Union

from plfl.data.partition import partitions
from plfl.errors import ConfigError
from plfl.fields import Component, checked, documented, one_of, registry, section

if TYPE_CHECKING:
    import numpy as np
    import torch

    from plfl.data.federated import FederatedData

DEFAULT_NUM_CLIENTS = 20  # data.num_clients of a partitioned source when unset

# What a pooled source reads: samples ``(n, ...)`` (a tensor, or texts that become one after the split), labels
# int64 (n,), the class count, and optionally further per-sample columns by name, arrays (n,) that a partition
# may split by (hf: FEMNIST's writer_id for NaturalIdPartitioner; see plfl.data.loading).
Pool = Union[tuple[Any, "torch.Tensor", int], tuple[Any, "torch.Tensor", int, Mapping[str, "np.ndarray"]]]


@dataclass
class DataSource(Component):
    """A data set (``data.source``): the keys every source reads; a subclass adds its own and reads its files."""

    source: str = one_of(
        "digits", lambda: tuple(data_sources()), "the data set and its reader (the data sources' guide)"
    )
    num_clients: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 1,
        "an integer >= 1",
        "clients of a partitioned source (null: 20); pfllib without repartition and leaf take theirs from the "
        "files, and a value set must agree",
    )
    augment: bool = documented(
        False,
        "images: each training sample is zero-padded by 4 pixels, randomly cropped back and flipped left-right "
        "with probability ½, drawn from the run's seeds; evaluation never augments",
    )
    val_fraction: float = checked(
        0.0,
        lambda v: 0 <= v < 1,
        "a number in [0, 1)",
        "share of each client's training split held out as its validation split (seeded, stratified by label where "
        "possible; every source, its own train/test split kept), never trained on; summary.json's selected_round "
        "is the round of best validation accuracy. 0: none",
    )

    rotation_groups: int = checked(
        1,
        lambda v: v >= 1,
        "an integer >= 1",
        "images: k groups of clients, client i in group i mod k, whose images (train, validation and test) are "
        "rotated by i mod k · 360°/k, as IFCA's rotated MNIST plants k clusters (1: none)",
    )
    rotation_mixture: Optional[float] = checked(
        None,
        lambda v: v is None or v > 0,
        "null or a number > 0",
        "with rotation_groups k > 1: every client mixes the k rotations, each of its samples (train, validation "
        "and test) turned by a group drawn from the client's own proportions ~ Dir(α, ..., α), α this value, "
        "seeded per client (FedEM's planted mixtures); null: whole clients by group",
    )

    def read(self) -> Union[Pool, FederatedData]:
        """A pooled source's :data:`Pool`, or the clients its files define.

        Raises:
            DataError: files missing, corrupt, unsafe or inconsistent; the message names the file and the fix.
        """
        raise NotImplementedError

    def partitioned(self) -> bool:
        """Whether ``data.partition`` splits this source over clients (else its files define them)."""
        return True

    def unpartitioned(self, key: str, value: Any) -> str:
        """The error for a partition key (``data.beta``, ...) set to ``value`` on a source that is not
        partitioned."""
        return f"data.{key}={value} has no effect: data.source={self.choice} keeps {self.keeps}. Remove data.{key}."

    keeps: ClassVar[str] = ""  # what of its files a source that is not partitioned keeps

    def encode(self, samples: Any, train_index: np.ndarray) -> Optional[tuple[torch.Tensor, int]]:
        """Pooled samples that become tensors only once split (texts): all of them as a tensor, by an encoder
        fitted on ``samples[train_index]`` (the clients' training samples) alone, and the vocabulary's size;
        None (default) when the samples are tensors already."""
        return None


@dataclass
class Files(DataSource):
    """A source read from files under ``data.root``."""

    root: Optional[str] = documented(
        None, "directory (or file) of the data; a relative path resolves against the current directory"
    )


@dataclass
class Text(DataSource):
    """A source of texts, encoded as token ids with a vocabulary learnt on the training texts only."""

    vocab_size: int = checked(
        32000,
        lambda v: v >= 3,
        "an integer >= 3",
        "text (agnews, leaf, hf): most token ids, [PAD] = 0 and [UNK] = 1 included; learnt on training texts only",
    )
    max_length: int = checked(
        200,
        lambda v: v >= 1,
        "an integer >= 1",
        "text (agnews, leaf, hf): token ids per sample; longer texts are cut, shorter ones padded with 0",
    )


@dataclass
class Digits(DataSource):
    """scikit-learn's bundled 8×8 digits: 1,797 images (1, 8, 8) in [0, 1], 10 classes; no files."""

    choice = "digits"

    def read(self) -> Pool:
        from plfl.data.vision import read_digits

        return read_digits()


@dataclass
class TorchvisionSource(Files):
    """A torchvision data set under ``data.root``, train and test sets pooled; images in [-1, 1]."""

    download: bool = documented(False, "torchvision sources: let torchvision download missing files (needs internet)")

    def read(self) -> Pool:
        from plfl.data.vision import read_torchvision

        return read_torchvision(self.choice, self.root, self.download)


@dataclass
class MNIST(TorchvisionSource):
    choice = "mnist"


@dataclass
class FashionMNIST(TorchvisionSource):
    choice = "fashionmnist"


@dataclass
class CIFAR10(TorchvisionSource):
    choice = "cifar10"


@dataclass
class CIFAR100(TorchvisionSource):
    choice = "cifar100"


@dataclass
class ImageFolder(Files):
    """``train/<class>/*`` and ``test/<class>/*`` images, pooled, normalised per channel over the pool."""

    choice = "imagefolder"
    cache_dir: Optional[str] = documented(
        None, "imagefolder: where decoded images are cached (null: $XDG_CACHE_HOME/plfl, else ~/.cache/plfl)"
    )

    def read(self) -> Pool:
        from plfl.data.imagefolder import load_image_folder

        return load_image_folder(self.root, self.cache_dir)


@dataclass
class AGNews(Text, Files):
    """AG News CSV files, pooled; texts become ``data.max_length`` token ids after the split."""

    choice = "agnews"
    train_file: str = documented("train.csv", "agnews: the training CSV under root (a prefix of train.csv works)")
    test_file: str = documented("test.csv", "agnews: the test CSV under root")

    def read(self) -> Pool:
        from plfl.data.agnews import read_agnews

        return read_agnews(self.root, self.train_file, self.test_file)

    def encode(self, samples: Any, train_index: np.ndarray) -> tuple[torch.Tensor, int]:
        """The texts as token ids from a vocabulary (at most ``data.vocab_size``) trained on the clients' training
        texts, so that no test text enters it: built here, after the split, not by the reader. FedALA's data
        (PFLlib's ``generate_AGNews.py``) builds it from all texts, test texts included."""
        return _token_ids(samples, train_index, self.vocab_size, self.max_length)


def _token_ids(samples: Any, train_index: np.ndarray, vocab_size: int, max_length: int) -> tuple[torch.Tensor, int]:
    """Texts as ``max_length`` token ids each, from a vocabulary of at most ``vocab_size`` ids learnt on
    ``samples[train_index]`` alone (:mod:`plfl.data.text`), and the vocabulary's size."""
    from plfl.data.text import encode, train_tokenizer

    tokenizer = train_tokenizer(samples[train_index], vocab_size)
    return encode(tokenizer, samples, max_length), tokenizer.get_vocab_size()


@dataclass
class HuggingFace(Text):
    """A Hugging Face ``datasets`` data set, by hub id or from a local copy, its splits pooled: images normalised
    per channel over the pool (as ``imagefolder``), or texts that become token ids after the split (as
    ``agnews``); its other columns can feed a partition (:mod:`plfl.data.hf`)."""

    choice = "hf"
    path: Optional[str] = documented(
        None,
        "hf: a hub id (uoft-cs/cifar10; needs internet, or the hub cache with HF_HUB_OFFLINE=1) or a local path: a "
        "save_to_disk directory, parquet or csv files, an image folder (<split>/<class>/*)",
    )
    subset: Optional[str] = documented(None, "hf: the hub data set's configuration (subset) name; null: its default")
    splits: Optional[list[str]] = checked(
        None,
        lambda v: v is None or (len(v) > 0 and len(set(v)) == len(v)),
        "null or a non-empty list of distinct split names",
        "hf: the splits pooled, in this order (null: all); plfl splits each client into train and test itself",
    )
    image_column: Optional[str] = documented(
        None, "hf: the column of images (null: the data set's only image column, unless text_column is set)"
    )
    text_column: Optional[str] = documented(None, "hf: the column of texts, which makes the samples token ids")
    label_column: str = documented(
        "label", "hf: the column of classes: a ClassLabel, integer ids, or strings (numbered in sorted order)"
    )

    def check(self) -> None:
        if self.path is None:
            raise ConfigError(
                "data.source=hf needs data.path: a hub id (e.g. uoft-cs/cifar10) or a local copy (a save_to_disk "
                "directory, parquet or csv files, an image folder). Set data.path."
            )
        if self.image_column is not None and self.text_column is not None:
            raise ConfigError(
                f"data.image_column={self.image_column} and data.text_column={self.text_column} are both set: the "
                "samples are either images or texts. Remove one of them."
            )
        if self.text_column is None:
            for f in dataclasses.fields(Text):
                if f.name in ("vocab_size", "max_length") and getattr(self, f.name) != f.default:
                    raise ConfigError(
                        f"data.{f.name}={getattr(self, f.name)} has no effect on images: data.source=hf reads texts "
                        f"only with data.text_column set. Set data.text_column, or remove data.{f.name}."
                    )

    def read(self) -> Pool:
        from plfl.data.hf import read_hf

        return read_hf(self.path, self.subset, self.splits, self.image_column, self.text_column, self.label_column)

    def encode(self, samples: Any, train_index: np.ndarray) -> Optional[tuple[torch.Tensor, int]]:
        """Texts (``data.text_column``) as token ids, as :meth:`AGNews.encode`; None for images."""
        if self.text_column is None:
            return None
        return _token_ids(samples, train_index, self.vocab_size, self.max_length)


@dataclass
class Repartitionable(Files):
    """Files that hold their own clients, which ``data.repartition`` pools and partitions anew."""

    repartition: bool = documented(
        False,
        "pfllib, leaf (images): pool all clients' train and test samples and partition them like a pooled source",
    )

    def partitioned(self) -> bool:
        return self.repartition

    def unpartitioned(self, key: str, value: Any) -> str:
        return (
            f"data.{key}={value} has no effect: data.source={self.choice} keeps {self.keeps}. Set "
            f"data.repartition=true to pool and re-partition them, or remove data.{key}."
        )


@dataclass
class PFLlib(Repartitionable):
    """A PFLlib / FedALA data directory: ``config.json``, ``train/`` and ``test/``, one file per client."""

    choice = "pfllib"
    keeps = "the clients and train/test splits of its files"

    def read(self) -> FederatedData:
        from plfl.data.pfllib import load_pfllib

        return load_pfllib(self.root, None if self.repartition else self.num_clients)


@dataclass
class Leaf(Text, Repartitionable):
    """LEAF JSON files (FEMNIST, Sent140, ...): one client per user, with the files' train/test split; images
    can be pooled and partitioned anew (``data.repartition``)."""

    choice = "leaf"
    keeps = "the users (one client each) and train/test splits of its files"
    image_shape: Optional[list[int]] = checked(
        None,
        lambda v: v is None or (len(v) > 0 and min(v) >= 1),
        "null or a non-empty list of integers >= 1",
        "leaf: the shape (C, H, W) each flat x row is reshaped to; required for image data ([1, 28, 28]: FEMNIST)",
    )
    num_classes: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 2,
        "null or an integer >= 2",
        "leaf: the class count (null: the largest label of both splits + 1; set it when classes may be absent)",
    )

    def check(self) -> None:
        if self.repartition and self.image_shape is None:
            raise ConfigError(
                "data.repartition=true with data.source=leaf pools images only (its texts are encoded with a "
                "vocabulary of the files' own training split): set data.image_shape, or remove data.repartition."
            )

    def read(self) -> FederatedData:
        from plfl.data.leaf import load_leaf

        num_clients = None if self.repartition else self.num_clients
        return load_leaf(self.root, self.image_shape, self.num_classes, self.vocab_size, self.max_length, num_clients)


@dataclass
class Shakespeare(Files):
    """A play's text, LEAF's next-character task: one client per speaking role."""

    choice = "shakespeare"
    keeps = "its speaking roles (one client each) and their train/test windows"
    min_chars: int = checked(
        10_000,
        lambda v: v >= 400,
        "an integer >= 400",
        "shakespeare: characters (= samples) a speaking role needs to be a client; >= 400 leaves every client a "
        "test window after LEAF's 79-window gap",
    )

    def read(self) -> FederatedData:
        from plfl.data.shakespeare import load_shakespeare

        return load_shakespeare(self.root, self.min_chars)

    def partitioned(self) -> bool:
        return False


def data_sources() -> dict[str, type[DataSource]]:
    """``data.source`` → its :class:`DataSource`."""
    return registry(DataSource)


DataConfig = section(
    "DataConfig",
    __name__,
    DataSource,
    [*data_sources().values(), *partitions().values()],
    "Which data set, and how it is split over clients (``data.*``): the keys of every source and every partition; "
    "a run's config sets those of its source and partition (:mod:`plfl.config` refuses the others).",
)
