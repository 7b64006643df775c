"""The model zoo's networks: 4-layer CNN (FedAvg/PFLlib), LeNet-5, MLP, ResNet-18; fastText and a small
Transformer for text; LEAF's character LSTM (``model.name`` and each model's keys: :mod:`plfl.models`).

Every model is a :class:`BodyHeadModel`: ``body`` maps an input batch to a
feature vector, ``head`` is the last classifier layer. Models take their
input shape and class count from the data, so switching data sets needs no
model change. ``batch_norm`` (``model.batch_norm``) puts a BatchNorm layer
before every ReLU of the CNN and the MLP, as FedBN's models have them (Li et
al., ICLR 2021, arXiv:2102.07623, App.: conv → BN → ReLU, fc → BN → ReLU).
The text models take int64 token ids ``(B, L)`` with 0 the padding id
(:mod:`plfl.data.text`) and the data's ``vocab_size``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from plfl.data.text import PAD_ID
from plfl.errors import ConfigError


class BodyHeadModel(nn.Module):
    """``head(body(x))``; ``body``: ``(B, *input_shape)`` → (B, F), ``head``: (B, F) → (B, classes) logits."""

    def __init__(self, body: nn.Module, head: nn.Linear):
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def channels_last(model: nn.Module) -> nn.Module:
    """``model``, converted in place to channels-last memory if it has convolutions: faster convolutions and
    pooling on the CPU (benchmarks/overhead.py's plain loop took 11-20 % less time with it)."""
    if any(isinstance(m, nn.Conv2d) for m in model.modules()):
        model.to(memory_format=torch.channels_last)
    return model


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
    convs, features = conv_stages(input_shape, "cnn", (32, 64), batch_norm)
    body = nn.Sequential(*convs, *normalized_relu(nn.Linear(features, 512), 512, batch_norm))
    return BodyHeadModel(body, nn.Linear(512, num_classes))


def conv_stages(
    input_shape: tuple[int, ...], name: str, widths: tuple[int, int], batch_norm: bool
) -> tuple[list[nn.Module], int]:
    """Two stages conv5×5 → (BatchNorm2d) → ReLU → maxpool2 of ``widths`` output channels, then a
    flatten, for (C, H, W) inputs; returns the layers and the flattened feature count.

    Raises:
        ConfigError: images smaller than 16×16 (nothing left after the two stages).
    """
    channels, height, width = _image_shape(input_shape, name)

    def conv_out(size: int) -> int:  # two (valid conv5, pool2) stages
        return ((size - 4) // 2 - 4) // 2

    if conv_out(height) < 1 or conv_out(width) < 1:
        raise ConfigError(
            f"model.name={name} needs images of at least 16×16 pixels; the data are {height}×{width}. "
            "Use model.name=mlp for small inputs such as digits."
        )
    first, second = widths
    layers = [
        *normalized_relu(nn.Conv2d(channels, first, kernel_size=5), first, batch_norm),
        nn.MaxPool2d(2),
        *normalized_relu(nn.Conv2d(first, second, kernel_size=5), second, batch_norm),
        nn.MaxPool2d(2),
        nn.Flatten(),
    ]
    return layers, second * conv_out(height) * conv_out(width)


def lenet5(input_shape: tuple[int, ...], num_classes: int, batch_norm: bool = False) -> BodyHeadModel:
    """LeNet-5 (LeCun et al., Proc. IEEE 1998) in the modern form FedFTHA's CIFAR experiments use.

    conv5×5(6) → ReLU → maxpool2 → conv5×5(16) → ReLU → maxpool2 → fc 120 → ReLU → fc 84 → ReLU
    → fc classes (the head), with ``batch_norm`` a BatchNorm before each ReLU. ReLU and max pooling
    replace the paper's scaled tanh and trainable subsampling; the paper's sparse C3 connections are
    full. The flattened dimension is 400 on 32×32 inputs (the paper's size) and 256 on 28×28.
    """
    convs, features = conv_stages(input_shape, "lenet5", (6, 16), batch_norm)
    body = nn.Sequential(
        *convs,
        *normalized_relu(nn.Linear(features, 120), 120, batch_norm),
        *normalized_relu(nn.Linear(120, 84), 84, batch_norm),
    )
    return BodyHeadModel(body, nn.Linear(84, num_classes))


def mclr(input_shape: tuple[int, ...], num_classes: int) -> BodyHeadModel:
    """Multinomial logistic regression (MCLR), FedProx's and Self-FL's MNIST model: flatten → Linear classes.

    The body is the flatten alone (no parameters, features = the ``prod(input_shape)`` input values); the head
    is the one linear layer, (classes, features) weights and (classes,) biases. Trained on the cross-entropy it
    is a convex problem.
    """
    return BodyHeadModel(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def mlp(
    input_shape: tuple[int, ...], num_classes: int, hidden_sizes: list[int], batch_norm: bool = False
) -> BodyHeadModel:
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
    from torchvision.models import resnet18  # torchvision's import is slow: only when a ResNet is built

    channels, _, _ = _image_shape(input_shape, "resnet18")
    net = resnet18(num_classes=num_classes)
    if channels != 3:
        net.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    head = net.fc
    net.fc = nn.Identity()
    return BodyHeadModel(net, head)


def mean_over_tokens(h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean of ``h`` (B, L, D) over the positions where ``keep`` (B, L) is true → (B, D); zeros where none is."""
    keep = keep.unsqueeze(-1).to(h.dtype)
    return (h * keep).sum(1) / keep.sum(1).clamp(min=1)


class MeanEmbedding(nn.Module):
    """The mean of a text's token embeddings, padding left out: (B, L) int64 → (B, embedding_dim).

    What ``nn.EmbeddingBag(mode="mean", padding_idx=0)`` computes, built on ``nn.Embedding`` because
    EmbeddingBag has no second derivative (Per-FedAvg's ``hf`` variant takes one).
    """

    def __init__(self, vocab_size: int, embedding_dim: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=PAD_ID)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mean_over_tokens(self.embedding(x), x != PAD_ID)


def fasttext(vocab_size: int, num_classes: int, embedding_dim: int) -> BodyHeadModel:
    """fastText from *Bag of Tricks for Efficient Text Classification* (Joulin et al., EACL 2017,
    arXiv:1607.01759), as FedALA and PFLlib build it (``fastText`` in their ``models.py``, hidden_dim 32).

    Body: :class:`MeanEmbedding` (``embedding_dim``) → Linear(embedding_dim, embedding_dim), no activation,
    as PFLlib's ``fc1``; head: Linear(embedding_dim, classes). Departure: the mean skips padding (a text
    without tokens gives zeros), where PFLlib averages over all ``max_length`` positions with zero padding
    vectors, which shrinks short texts' features. PFLlib's log-softmax output is left out: plfl's loss
    takes logits.
    """
    body = nn.Sequential(MeanEmbedding(vocab_size, embedding_dim), nn.Linear(embedding_dim, embedding_dim))
    return BodyHeadModel(body, nn.Linear(embedding_dim, num_classes))


class TransformerBody(nn.Module):
    """Token + learned position embeddings → ``nn.TransformerEncoder`` → mean over the non-padding tokens.

    (B, L) int64 ids → (B, embedding_dim). Post-norm layers with a 4 × embedding_dim feed-forward width
    and no dropout. A text without tokens keeps its first (padding) position unmasked: attention over no
    key at all would give NaN. Attention runs on PyTorch's math kernel: the fused CPU kernels have no second
    derivative, which Per-FedAvg's ``hf`` variant takes.
    """

    def __init__(self, vocab_size: int, max_length: int, embedding_dim: int, num_layers: int, num_heads: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, embedding_dim, padding_idx=PAD_ID)
        self.positions = nn.Embedding(max_length, embedding_dim)
        layer = nn.TransformerEncoderLayer(embedding_dim, num_heads, 4 * embedding_dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = x == PAD_ID
        padding[:, 0] = False  # texts start at position 0, so this changes only texts without tokens
        with sdpa_kernel(SDPBackend.MATH):
            h = self.encoder(self.tokens(x) + self.positions.weight[: x.shape[1]], src_key_padding_mask=padding)
        return mean_over_tokens(h, ~padding)


def transformer(
    vocab_size: int, input_shape: tuple[int, ...], num_classes: int, embedding_dim: int, num_layers: int, num_heads: int
) -> BodyHeadModel:
    """A small Transformer encoder (Vaswani et al., NeurIPS 2017, arXiv:1706.03762) for token ids of length
    ``input_shape[0]``: :class:`TransformerBody` → Linear(embedding_dim, classes)."""
    body = TransformerBody(vocab_size, input_shape[0], embedding_dim, num_layers, num_heads)
    return BodyHeadModel(body, nn.Linear(embedding_dim, num_classes))


class LastStepLSTM(nn.Module):
    """Embedding → stacked LSTM → the last time step's output: (B, L) int64 ids → (B, hidden_dim)."""

    def __init__(self, vocab_size: int, embedding_dim: int, hidden_dim: int, num_layers: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden_dim, num_layers, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs, _ = self.lstm(self.embedding(x))
        return outputs[:, -1]


def lstm(
    input_shape: tuple[int, ...], num_classes: int, vocab_size: int, embedding_dim: int = 8, hidden_dim: int = 256
) -> BodyHeadModel:
    """LEAF's Shakespeare model (Caldas et al., arXiv:1812.01097, ``models/shakespeare/stacked_lstm.py``; the
    FedAvg paper's character LSTM): embedding 8 → 2-layer LSTM 256 → Linear classes on the last time step.

    Inputs are int64 token ids ``(B, L)`` in ``[0, vocab_size)``; no id is treated as padding.
    """
    return BodyHeadModel(LastStepLSTM(vocab_size, embedding_dim, hidden_dim), nn.Linear(hidden_dim, num_classes))


def _image_shape(input_shape: tuple[int, ...], name: str) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ConfigError(f"model.name={name} needs image inputs (C, H, W); the data have shape {input_shape}.")
    return input_shape  # type: ignore[return-value]


def modulated(features: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """ReLU(f ⊙ (γ + 1) + β): features f (B, F) scaled and shifted feature-wise by γ, β (F,) or (B, F)."""
    return torch.relu(features * (gamma + 1) + beta)


class ConditionalValve(nn.Module):
    """A feature-wise affine valve driven by a condition vector c (F,): γ = LayerNorm(ReLU(W_γ c + b_γ)) and
    β = LayerNorm(ReLU(W_β c + b_β)), then :func:`modulated` (GPFL's Conditional Valve, Zhang et al., ICCV 2023).
    ``gamma`` and ``beta`` are ``Linear → ReLU → LayerNorm`` stacks (F → F), built in that order."""

    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.LayerNorm([dim]))
        self.beta = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.LayerNorm([dim]))

    def forward(self, features: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        """(B, F) features, (F,) condition → (B, F) valved features."""
        return modulated(features, self.gamma(condition), self.beta(condition))


class ValvedBody(nn.Module):
    """A body followed by a :class:`ConditionalValve` under the condition held in the buffer ``condition`` (F,):
    ``(B, *input_shape)`` → (B, F). The condition is a buffer: it belongs to a client's state, not to training."""

    def __init__(self, backbone: nn.Module, dim: int):
        super().__init__()
        self.backbone = backbone
        self.valve = ConditionalValve(dim)
        self.register_buffer("condition", torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.valve(self.backbone(x), self.condition)


class ValvedModel(BodyHeadModel):
    """``head(valve(body(x), condition))`` (a :class:`ValvedBody` as its body) beside a table of class embeddings
    ``embedding`` (classes, F), which the forward pass does not use: GPFL's client model (the feature extractor,
    the Conditional Valve under the personalized condition, the head) and its Global Category Embedding layer."""

    def __init__(self, body: ValvedBody, head: nn.Linear, embedding: nn.Embedding):
        super().__init__(body, head)
        self.embedding = embedding


def valved(model: BodyHeadModel) -> ValvedModel:
    """``model``'s body and head with a class embedding table (``nn.Embedding(classes, F)``, built first) and a
    :class:`ConditionalValve` (then) between them, F = the head's input width: the order of GPFL's modules in the
    authors' code, so that the same random state initialises them alike.

    Raises:
        ConfigError: the head is not one ``nn.Linear`` layer.
    """
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear):
        raise ConfigError(
            f"a valved model needs an nn.Linear head; {type(model).__name__} has {type(head).__name__} as its head. "
            "Choose a model of plfl.models."
        )
    dim, classes = model.head.in_features, model.head.out_features
    embedding = nn.Embedding(classes, dim)
    return ValvedModel(ValvedBody(model.body, dim), model.head, embedding)
