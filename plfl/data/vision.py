"""Image data sets that their libraries read: scikit-learn's bundled digits, and torchvision's MNIST,
Fashion-MNIST, CIFAR-10 and CIFAR-100 (pooled train and test sets, as PFLlib pools them)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from plfl.errors import DataError


def read_digits() -> tuple[torch.Tensor, torch.Tensor, int]:
    """scikit-learn's bundled 8x8 digits: 1,797 images ``(1, 8, 8)`` in [0, 1], 10 classes."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.from_numpy((digits.images / 16.0).astype(np.float32)).unsqueeze(1).contiguous()
    return x, torch.from_numpy(digits.target.astype(np.int64)), 10


# source -> (torchvision class name, number of classes, folder under root, what goes there)
TORCHVISION = {
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


def read_torchvision(source: str, root: Optional[str], download: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The train and test sets of the torchvision data set ``source`` (``data.source``) under ``root``
    (``data.root``; torchvision downloads it there with ``download``), pooled (as PFLlib does).

    Returns ``x`` float32 ``(n, C, H, W)`` in [-1, 1], ``y`` int64 ``(n,)``, the class count.

    Raises:
        DataError: ``root`` unset, or the files are missing (and could not be downloaded).
    """
    import torchvision.datasets

    cls_name, num_classes, folder, contents = TORCHVISION[source]
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
