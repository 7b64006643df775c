"""Training-time image augmentation, drawn per sample from an explicit generator (no global RNG)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from plfl.data.federated import FederatedData
from plfl.errors import ConfigError

Transform = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def augmentation(augment: bool, data: FederatedData) -> Optional[Transform]:
    """The training batch transform ``data.augment`` asks for (None: none).

    Raises:
        ConfigError: ``augment`` is set for data that are not images (C, H, W).
    """
    if not augment:
        return None
    if len(data.input_shape) != 3 or data.vocab_size is not None:
        raise ConfigError(
            f"data.augment=true crops and flips images (C, H, W), but data.source={data.name} "
            f"gives inputs of shape {data.input_shape}. Remove data.augment."
        )
    return random_crop_flip


def random_crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """The CIFAR standard augmentation: each image of the batch zero-padded by ``padding`` pixels on
    every side, cropped back to its size at a random offset, and flipped left-right with probability ½.

    ``x`` is float ``(B, C, H, W)`` (any device); the offsets and flips are drawn on the CPU from
    ``generator``, so one generator state gives the same batch everywhere. Zero is the data set's
    mean after plfl's normalisation (torchvision's ``RandomCrop(padding=4)`` pads before normalising,
    with black). Returns a new tensor of ``x``'s shape.

    Raises:
        ValueError: ``x`` is not a 4-d batch of images.
    """
    if x.ndim != 4 or not x.is_floating_point():
        raise ValueError(f"random_crop_flip needs a float (B, C, H, W) image batch, got {x.dtype} {tuple(x.shape)}")
    n, channels, height, width = x.shape
    offsets = torch.randint(0, 2 * padding + 1, (2, n, 1), generator=generator).to(x.device)
    flips = (torch.rand(n, 1, generator=generator) < 0.5).to(x.device)
    rows = offsets[0] + torch.arange(height, device=x.device)  # (B, H): the crop's rows in the padded image
    cols = offsets[1] + torch.arange(width, device=x.device)
    cols = torch.where(flips, cols.flip(1), cols)  # reading the columns backwards flips the crop
    padded = F.pad(x, (padding,) * 4)
    index = (
        torch.arange(n, device=x.device)[:, None, None, None],
        torch.arange(channels, device=x.device)[:, None, None],
    )
    return padded[index[0], index[1], rows[:, None, :, None], cols[:, None, None, :]]
