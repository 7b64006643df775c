"""An image-folder data set: ``root/{train,test}/<class>/<image>``, decoded once and cached.

The layout of torchvision's ``ImageFolder`` per split (CIFAR-10/100 or Tiny-ImageNet exported as
files): the sorted class folder names of ``train/`` give labels 0..K-1, and ``test/`` must hold
the same folders. Train and test are pooled (as PFLlib and FedALA do); plfl partitions the pool.

Decoding tens of thousands of images takes seconds, so the decoded uint8 images, labels and class
names are cached in ``cache_dir`` as a ``torch.save`` file of tensors and strings only (read back
with ``weights_only=True``), named by a hash of every file's relative path, size and modification
time and of :data:`FORMAT_VERSION`: changing, adding or removing an image builds a new cache.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from PIL import Image

from plfl.errors import DataError, PlflWarning

# Part of the cache key: raise it whenever the decoded tensors would come out differently.
FORMAT_VERSION = 1
_SPLITS = ("train", "test")
_GREY_MODES = ("1", "L", "LA", "I", "I;16", "F")  # PIL modes decoded to one channel (L)


def load_image_folder(root: Optional[str], cache_dir: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Read every image under ``root/train`` and ``root/test``, pooled, train first.

    Args:
        root: the directory holding ``train/<class>/*`` and ``test/<class>/*``; a class folder holds
            image files of any format PIL reads (names starting with a dot are skipped).
        cache_dir: where decoded images are cached (created if needed); None: ``$XDG_CACHE_HOME/plfl``,
            else ``~/.cache/plfl``. It must not lie inside ``root``.

    Returns:
        ``x`` float32 ``(n, C, H, W)`` normalised per channel with the mean and standard deviation of
        all n pooled images (pixels scaled to [0, 1] first; a constant channel is only centred),
        ``y`` int64 ``(n,)`` labels, and the number of classes K. C is 3 (RGB) if any image has
        colour, else 1 (L); greyscale images in a colour set are replicated to RGB as PIL converts
        them (Tiny-ImageNet holds a few), and alpha channels are dropped.

    Raises:
        DataError: ``root`` is unset or lacks ``train/`` or ``test/``; ``train/`` has no class folder;
            the two splits hold different class folders; a class folder holds no image; an image
            cannot be decoded (the file is named); images differ in size (the file is named);
            ``cache_dir`` lies inside ``root``.
    """
    if root is None:
        raise DataError(
            "data.source=imagefolder needs data.root: a directory holding train/<class>/* and "
            "test/<class>/*. Set data.root=<directory>."
        )
    root_dir = Path(root)
    classes, files = _list_files(root_dir)
    cache = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    if cache.resolve().is_relative_to(root_dir.resolve()):
        raise DataError(
            f"data.cache_dir={cache} lies inside data.root={root_dir}; the cache must not be "
            "written into the data. Set data.cache_dir to a directory outside it, or leave it unset."
        )
    path = cache / f"imagefolder-{_cache_key(root_dir, files)}.pt"
    images, labels = _read_cache(path, classes, len(files))
    if images is None:
        images, labels = _decode(root_dir, files)
        _write_cache(path, images, labels, classes)
    return normalise_channels(images), labels, len(classes)


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "plfl"


def _list_files(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Class names (sorted) and (path relative to ``root``, label) of every image, train then test."""
    layout = "train/<class>/<image> and test/<class>/<image>"
    if not root.is_dir():
        raise DataError(f"Image folder {root} does not exist. Set data.root to a directory holding {layout}.")
    found = {}
    for split in _SPLITS:
        folder = root / split
        if not folder.is_dir():
            raise DataError(
                f"{folder} does not exist. An image folder data set holds {layout}: add {split}/ "
                "or point data.root at the right directory."
            )
        found[split] = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    classes = found["train"]
    if not classes:
        raise DataError(
            f"{root / 'train'} holds no class folder. Put each class's images in its own folder under it ({layout})."
        )
    if found["test"] != classes:
        only_train = sorted(set(classes) - set(found["test"]))
        only_test = sorted(set(found["test"]) - set(classes))
        raise DataError(
            f"{root / 'train'} and {root / 'test'} hold different class folders (only in train: "
            f"{only_train or 'none'}; only in test: {only_test or 'none'}). Both splits need the same "
            "class folders, since their sorted names give the labels."
        )
    files = []
    for split in _SPLITS:
        for label, name in enumerate(classes):
            folder = root / split / name
            images = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
            if not images:
                raise DataError(
                    f"Class folder {folder} holds no image. Add its images or remove the class "
                    "from both train/ and test/."
                )
            files += [(f"{split}/{name}/{image}", label) for image in images]
    return classes, files


def _cache_key(root: Path, files: list[tuple[str, int]]) -> str:
    digest = hashlib.sha256(f"plfl imagefolder v{FORMAT_VERSION}\n".encode())
    for rel, label in files:
        stat = (root / rel).stat()
        digest.update(f"{rel}\0{label}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def _decode(root: Path, files: list[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 ``(n, C, H, W)`` images and int64 labels of ``files``."""
    images = decode_images([(str(root / rel), root / rel) for rel, _ in files])
    return images, torch.tensor([label for _, label in files], dtype=torch.int64)


def decode_images(images: Sequence[tuple[str, Any]]) -> torch.Tensor:
    """uint8 ``(n, C, H, W)`` of ``images``, each ``(name, what PIL opens: a path or a binary file)``: RGB if any
    image has colour (grey ones replicated in every channel, as PIL converts L to RGB), else one grey channel;
    alpha dropped.

    Raises:
        DataError: an image PIL cannot open, or of another size than the first; the message names it ("Image
            <name> ...").
    """
    pixels_all: Optional[np.ndarray] = None  # (n, H, W, 3); a grey image fills channel 0 only
    grey = np.zeros(len(images), dtype=bool)
    first = images[0][0]
    for i, (name, source) in enumerate(images):
        try:
            with Image.open(source) as image:
                grey[i] = image.mode in _GREY_MODES
                pixels = np.asarray(image.convert("L" if grey[i] else "RGB"))
        except Exception as e:  # noqa: BLE001  PIL raises many types on untrusted files; every one means unreadable
            raise DataError(
                f"Image {name} cannot be read ({type(e).__name__}: {e}). Replace or remove it; every image must be a "
                "file PIL can open."
            ) from None
        if pixels_all is None:
            pixels_all = np.empty((len(images), *pixels.shape[:2], 3), dtype=np.uint8)
        if pixels.shape[:2] != pixels_all.shape[1:3]:
            height, width = pixels_all.shape[1:3]
            raise DataError(
                f"Image {name} is {pixels.shape[1]}×{pixels.shape[0]} pixels but image {first} is {width}×{height}. "
                "All images of a data set must have one size: resize them first."
            )
        pixels_all[i, ..., : 1 if grey[i] else 3] = pixels.reshape(*pixels.shape[:2], -1)
    assert pixels_all is not None, "no image to decode"
    if grey.all():
        pixels_all = pixels_all[..., :1]
    else:  # grey images become RGB as PIL converts L to RGB: the value in every channel
        pixels_all[grey, ..., 1:] = pixels_all[grey, ..., :1]
    return torch.from_numpy(pixels_all).permute(0, 3, 1, 2).contiguous()


def _read_cache(path: Path, classes: list[str], n: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The cached images and labels, or (None, None) when there is no usable cache file."""
    try:
        cached = torch.load(path, weights_only=True)
    except FileNotFoundError:
        return None, None
    except Exception as e:  # noqa: BLE001  a damaged file is rebuilt, not trusted
        warnings.warn(
            f"Image cache {path} cannot be read ({type(e).__name__}); decoding the images again.",
            PlflWarning,
            stacklevel=3,
        )
        return None, None
    if not isinstance(cached, dict):
        return None, None
    images, labels = cached.get("images"), cached.get("labels")
    valid = (
        cached.get("classes") == classes
        and isinstance(images, torch.Tensor)
        and images.dtype == torch.uint8
        and images.ndim == 4
        and len(images) == n
        and isinstance(labels, torch.Tensor)
        and labels.shape == (n,)
    )
    return (images, labels) if valid else (None, None)


def _write_cache(path: Path, images: torch.Tensor, labels: torch.Tensor, classes: list[str]) -> None:
    """Save atomically (a temporary file in the same directory, then ``os.replace``): an interrupted
    run leaves no partial cache. A cache that cannot be written only costs decoding again next time."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
            tmp = f.name
            torch.save({"images": images, "labels": labels, "classes": classes}, f)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        warnings.warn(
            f"Could not write the image cache {path} ({e}); the images will be decoded again next "
            "time. Set data.cache_dir to a writable directory.",
            PlflWarning,
            stacklevel=3,
        )


def normalise_channels(images: torch.Tensor) -> torch.Tensor:
    """float32 ``(x / 255 - mean) / std`` per channel, mean and std over all images (from exact
    per-channel histograms of the uint8 values)."""
    channels = images.shape[1]
    counts = torch.stack([torch.bincount(images[:, c].reshape(-1), minlength=256) for c in range(channels)])
    values = torch.arange(256, dtype=torch.float64) / 255
    total = counts.sum(dim=1, dtype=torch.float64)
    mean = (counts * values).sum(dim=1) / total
    std = ((counts * (values - mean[:, None]) ** 2).sum(dim=1) / total).sqrt()
    std = torch.where(std > 0, std, torch.ones_like(std))
    shape = (1, channels, 1, 1)
    x = images.to(torch.float32).div_(255)
    return x.sub_(mean.float().view(shape)).div_(std.float().view(shape))
