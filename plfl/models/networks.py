"""The model zoo: 4-layer CNN (FedAvg/PFLlib), LeNet-5, MLP, ResNet-18.

Every model is a :class:`BodyHeadModel`: ``body`` maps an input batch to a
feature vector, ``head`` is the last classifier layer. Models take their
input shape and class count from the data, so switching data sets needs no
model change. ``batch_norm`` (``model.batch_norm``) puts a BatchNorm layer
before every ReLU of the CNN and the MLP, as FedBN's models have them (Li et
al., ICLR 2021, arXiv:2102.07623, App.: conv → BN → ReLU, fc → BN → ReLU).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn
from torchvision.models import resnet18

from plfl.errors import ConfigError


class BodyHeadModel(nn.Module):
    """``head(body(x))``; ``body``: (B, *input_shape) → (B, F), ``head``: (B, F) → (B, classes) logits."""

    def __init__(self, body: nn.Module, head: nn.Linear):
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def normalized_relu(layer: nn.Module, width: int, batch_norm: bool) -> list[nn.Module]:
    """``layer → ReLU``, or ``layer → BatchNorm → ReLU`` (BatchNorm2d after a convolution, else 1d)."""
    if not batch_norm:
        return [layer, nn.ReLU(inplace=True)]
    norm = nn.BatchNorm2d(width) if isinstance(layer, nn.Conv2d) else nn.BatchNorm1d(width)
    return [layer, norm, nn.ReLU(inplace=True)]


def cnn(input_shape: tuple[int, ...], num_classes: int, batch_norm: bool = False) -> BodyHeadModel:
    """The 4-layer CNN of FedAvg (McMahan et al., 2017) as used by PFLlib and FedALA.

    conv5×5(32) → ReLU → maxpool2 → conv5×5(64) → ReLU → maxpool2 → fc 512 → ReLU → fc classes,
    with ``batch_norm`` a BatchNorm before each ReLU. The flattened dimension is 1024 on 28×28
    inputs and 1600 on 32×32.
    """
    channels, height, width = _image_shape(input_shape, "cnn")
    conv_out = lambda s: ((s - 4) // 2 - 4) // 2  # noqa: E731  two (valid conv5, pool2) stages
    if conv_out(height) < 1 or conv_out(width) < 1:
        raise ConfigError(
            f"model.name=cnn needs images of at least 16×16 pixels; the data are {height}×{width}. "
            "Use model.name=mlp for small inputs such as digits."
        )
    body = nn.Sequential(
        *normalized_relu(nn.Conv2d(channels, 32, kernel_size=5), 32, batch_norm), nn.MaxPool2d(2),
        *normalized_relu(nn.Conv2d(32, 64, kernel_size=5), 64, batch_norm), nn.MaxPool2d(2),
        nn.Flatten(),
        *normalized_relu(nn.Linear(64 * conv_out(height) * conv_out(width), 512), 512, batch_norm),
    )
    return BodyHeadModel(body, nn.Linear(512, num_classes))


def lenet5(input_shape: tuple[int, ...], num_classes: int, batch_norm: bool = False) -> BodyHeadModel:
    """LeNet-5 (LeCun et al., Proc. IEEE 1998) in the modern form FedFTHA's CIFAR experiments use.

    conv5×5(6) → ReLU → maxpool2 → conv5×5(16) → ReLU → maxpool2 → fc 120 → ReLU → fc 84 → ReLU
    → fc classes (the head), with ``batch_norm`` a BatchNorm before each ReLU. ReLU and max pooling
    replace the paper's scaled tanh and trainable subsampling; the paper's sparse C3 connections are
    full. The flattened dimension is 400 on 32×32 inputs (the paper's size) and 256 on 28×28.
    """
    channels, height, width = _image_shape(input_shape, "lenet5")
    conv_out = lambda s: ((s - 4) // 2 - 4) // 2  # noqa: E731  two (valid conv5, pool2) stages
    if conv_out(height) < 1 or conv_out(width) < 1:
        raise ConfigError(
            f"model.name=lenet5 needs images of at least 16×16 pixels; the data are {height}×{width}. "
            "Use model.name=mlp for small inputs such as digits."
        )
    body = nn.Sequential(
        *normalized_relu(nn.Conv2d(channels, 6, kernel_size=5), 6, batch_norm), nn.MaxPool2d(2),
        *normalized_relu(nn.Conv2d(6, 16, kernel_size=5), 16, batch_norm), nn.MaxPool2d(2),
        nn.Flatten(),
        *normalized_relu(nn.Linear(16 * conv_out(height) * conv_out(width), 120), 120, batch_norm),
        *normalized_relu(nn.Linear(120, 84), 84, batch_norm),
    )
    return BodyHeadModel(body, nn.Linear(84, num_classes))


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden_sizes: list[int],
        batch_norm: bool = False) -> BodyHeadModel:
    """Fully connected network: flatten → [Linear → (BatchNorm1d if ``batch_norm``) → ReLU] per
    hidden size → Linear classes."""
    if not hidden_sizes:
        raise ConfigError("model.hidden_sizes must list at least one hidden layer width for model.name=mlp.")
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for hidden in hidden_sizes:
        layers += normalized_relu(nn.Linear(width, hidden), hidden, batch_norm)
        width = hidden
    return BodyHeadModel(nn.Sequential(*layers), nn.Linear(width, num_classes))


def resnet(input_shape: tuple[int, ...], num_classes: int) -> BodyHeadModel:
    """torchvision's ResNet-18 (random init), first convolution adapted to the input channels."""
    channels, _, _ = _image_shape(input_shape, "resnet18")
    net = resnet18(num_classes=num_classes)
    if channels != 3:
        net.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    head = net.fc
    net.fc = nn.Identity()
    return BodyHeadModel(net, head)


# model.name → builder(input_shape, num_classes, options); options: the ModelConfig keys
# (hidden_sizes, batch_norm, ...) and the data's vocab_size (None for images).
MODELS: dict[str, Callable[..., BodyHeadModel]] = {
    "cnn": lambda shape, classes, o: cnn(shape, classes, o.get("batch_norm", False)),
    "mlp": lambda shape, classes, o: mlp(shape, classes, list(o.get("hidden_sizes", [200])), o.get("batch_norm", False)),
    "resnet18": lambda shape, classes, o: resnet(shape, classes),
    "lenet5": lambda shape, classes, o: lenet5(shape, classes, o.get("batch_norm", False)),
}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, hidden_sizes: list[int] = (200,),
                batch_norm: bool = False, **options: Any) -> BodyHeadModel:
    """Build ``model.name`` for inputs of ``input_shape`` (no batch dim) and ``num_classes`` classes;
    ``hidden_sizes``: the MLP's widths; ``batch_norm``: BatchNorm layers in the CNN, LeNet-5 and the MLP
    (ResNet-18 always has them, and ``ModelConfig`` refuses ``model.batch_norm`` with it);
    ``options``: further ``model.*`` keys and the data's ``vocab_size``, for the models that read them.

    Raises:
        ConfigError: unknown name, or inputs the network cannot take.
    """
    if name not in MODELS:
        raise ConfigError(f"Unknown model.name {name!r}; valid names: {', '.join(MODELS)}.")
    return MODELS[name](input_shape, num_classes, {"hidden_sizes": hidden_sizes, "batch_norm": batch_norm, **options})


def _image_shape(input_shape: tuple[int, ...], name: str) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ConfigError(f"model.name={name} needs image inputs (C, H, W); the data have shape {input_shape}.")
    return input_shape  # type: ignore[return-value]
