"""The model zoo: 4-layer CNN (FedAvg/PFLlib), MLP, ResNet-18, LEAF's character LSTM.

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
    "lstm": lambda shape, classes, o: lstm(shape, classes, o.get("vocab_size"), o.get("embedding_dim", 8),
                                           o.get("hidden_dim", 256)),
}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, hidden_sizes: list[int] = (200,),
                batch_norm: bool = False, **options: Any) -> BodyHeadModel:
    """Build ``model.name`` for inputs of ``input_shape`` (no batch dim) and ``num_classes`` classes;
    ``hidden_sizes``: the MLP's widths; ``batch_norm``: BatchNorm layers in the CNN and the MLP
    (ResNet-18 always has them, and ``ModelConfig`` refuses ``model.batch_norm`` with it);
    ``options``: further ``model.*`` keys and the data's ``vocab_size``, for the models that read them.

    Raises:
        ConfigError: unknown name, or inputs the network cannot take.
    """
    if name not in MODELS:
        raise ConfigError(f"Unknown model.name {name!r}; valid names: {', '.join(MODELS)}.")
    return MODELS[name](input_shape, num_classes, {"hidden_sizes": hidden_sizes, "batch_norm": batch_norm, **options})


class LastStepLSTM(nn.Module):
    """Embedding → stacked LSTM → the last time step's output: (B, L) int64 ids → (B, hidden_dim)."""

    def __init__(self, vocab_size: int, embedding_dim: int, hidden_dim: int, num_layers: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden_dim, num_layers, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs, _ = self.lstm(self.embedding(x))
        return outputs[:, -1]


def lstm(input_shape: tuple[int, ...], num_classes: int, vocab_size: int | None, embedding_dim: int = 8,
         hidden_dim: int = 256) -> BodyHeadModel:
    """LEAF's Shakespeare model (Caldas et al., arXiv:1812.01097, ``models/shakespeare/stacked_lstm.py``; the
    FedAvg paper's character LSTM): embedding 8 → 2-layer LSTM 256 → Linear classes on the last time step.

    Inputs are int64 token ids ``(B, L)`` in ``[0, vocab_size)``; no id is treated as padding.
    """
    if vocab_size is None or len(input_shape) != 1:
        raise ConfigError(f"model.name=lstm needs token-id sequences (data.source=shakespeare); the data have "
                          f"shape {input_shape} and no vocabulary. Use model.name=cnn or mlp for images.")
    return BodyHeadModel(LastStepLSTM(vocab_size, embedding_dim, hidden_dim), nn.Linear(hidden_dim, num_classes))


def _image_shape(input_shape: tuple[int, ...], name: str) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ConfigError(f"model.name={name} needs image inputs (C, H, W); the data have shape {input_shape}.")
    return input_shape  # type: ignore[return-value]
