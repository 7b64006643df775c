"""The models ``model.name`` names, each with the keys it reads, and the ``model.*`` section they make up.

Every model is a :class:`~plfl.models.networks.BodyHeadModel` with a body (representation) and a head (the last
classifier layer), its input shape and class count taken from the data. A model is a :class:`Model`: a
dataclass of its keys, its name and :meth:`Model.build`, which calls its builder in :mod:`plfl.models.networks`
(imported then: a config is checked without torch). :data:`ModelConfig` is the ``model.*`` section: every
model's keys, of which a run's config sets only those its model reads (:mod:`plfl.config` checks that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from plfl.errors import ConfigError
from plfl.fields import Component, checked, documented, one_of, registry, section

if TYPE_CHECKING:
    from plfl.models.networks import BodyHeadModel

__all__ = ["BodyHeadModel", "Model", "ModelConfig", "build_model", "channels_last", "models"]


@dataclass
class Model(Component):
    """A network (``model.name``): the key every model has; a subclass adds its own keys and builds it."""

    text: ClassVar[bool] = False  # takes int64 token ids (B, L) and needs the data's vocab_size
    name: str = one_of(
        "mlp",
        lambda: tuple(models()),
        "the network, split into a body (representation) and a head (last classifier layer): mclr (multinomial "
        "logistic regression), mlp, cnn (FedAvg's 4-layer CNN), lenet5 (also PyTorch's CIFAR-10 tutorial CNN), "
        "resnet18 (torchvision); for text fasttext, transformer, lstm (LEAF's)",
    )

    def build(self, input_shape: tuple[int, ...], num_classes: int, vocab_size: Optional[int]) -> BodyHeadModel:
        """The network for inputs of ``input_shape`` (no batch dim), ``num_classes`` classes and, for text, the
        data's ``vocab_size`` (None for images and vectors).

        Raises:
            ConfigError: inputs the network cannot take (a text model on images, an image model on token ids).
        """
        if (vocab_size is not None) != self.text:
            kind = "token ids (text)" if vocab_size is not None else "images or vectors"
            use = [n for n, cls in models().items() if cls.text == (vocab_size is not None)]
            raise ConfigError(
                f"model.name={self.choice} cannot take the data's {kind}; use model.name={' or '.join(use)}."
            )
        return self.network(input_shape, num_classes, vocab_size)

    def network(self, input_shape: tuple[int, ...], num_classes: int, vocab_size: Optional[int]) -> BodyHeadModel:
        raise NotImplementedError


@dataclass
class BatchNormOption(Model):
    """A model that can put a BatchNorm layer before every ReLU (FedBN's models)."""

    batch_norm: bool = documented(
        False, "cnn, lenet5, mlp: a BatchNorm layer before every ReLU (FedBN's models); resnet18 always has them"
    )


@dataclass
class Embedding(Model):
    """A text model: token embeddings of ``embedding_dim``."""

    text = True
    embedding_dim: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 1,
        "an integer >= 1",
        "fasttext, transformer, lstm: width of the token embeddings (null: 32 for fasttext and transformer, "
        "as FedALA's fastText; 8 for lstm, as LEAF's)",
    )


@dataclass
class MLP(BatchNormOption):
    choice = "mlp"
    hidden_sizes: list[int] = documented(doc="mlp: widths of the hidden layers", default_factory=lambda: [200])

    def network(self, input_shape: tuple[int, ...], num_classes: int, vocab_size: Optional[int]) -> BodyHeadModel:
        from plfl.models.networks import mlp

        return mlp(input_shape, num_classes, list(self.hidden_sizes), self.batch_norm)


@dataclass
class MCLR(Model):
    choice = "mclr"

    def network(self, input_shape: tuple[int, ...], num_classes: int, vocab_size: Optional[int]) -> BodyHeadModel:
        from plfl.models.networks import mclr

        return mclr(input_shape, num_classes)


@dataclass
class CNN(BatchNormOption):
    choice = "cnn"

    def network(self, input_shape: tuple[int, ...], num_classes: int, vocab_size: Optional[int]) -> BodyHeadModel:
        from plfl.models.networks import cnn

        return cnn(input_shape, num_classes, self.batch_norm)


@dataclass
class LeNet5(BatchNormOption):
    choice = "lenet5"

    def network(self, input_shape: tuple[int, ...], num_classes: int, vocab_size: Optional[int]) -> BodyHeadModel:
        from plfl.models.networks import lenet5

        return lenet5(input_shape, num_classes, self.batch_norm)


@dataclass
class ResNet18(Model):
    choice = "resnet18"
    notes: ClassVar[dict[str, str]] = {"batch_norm": "resnet18 always has BatchNorm layers"}

    def network(self, input_shape: tuple[int, ...], num_classes: int, vocab_size: Optional[int]) -> BodyHeadModel:
        from plfl.models.networks import resnet

        return resnet(input_shape, num_classes)


@dataclass
class FastText(Embedding):
    choice = "fasttext"

    def network(self, input_shape: tuple[int, ...], num_classes: int, vocab_size: Optional[int]) -> BodyHeadModel:
        from plfl.models.networks import fasttext

        return fasttext(vocab_size, num_classes, self.embedding_dim or 32)


@dataclass
class Transformer(Embedding):
    choice = "transformer"
    num_layers: int = checked(2, lambda v: v >= 1, "an integer >= 1", "transformer: encoder layers")
    num_heads: int = checked(
        2, lambda v: v >= 1, "an integer >= 1", "transformer: attention heads per layer (divides embedding_dim)"
    )

    def check(self) -> None:
        if self.embedding_dim and self.embedding_dim % self.num_heads:
            raise ConfigError(
                f"model.embedding_dim={self.embedding_dim} is not a multiple of model.num_heads="
                f"{self.num_heads}: each attention head takes an equal share of the embedding. "
                "Change one of them."
            )

    def network(self, input_shape: tuple[int, ...], num_classes: int, vocab_size: Optional[int]) -> BodyHeadModel:
        from plfl.models.networks import transformer

        dim = self.embedding_dim or 32
        return transformer(vocab_size, input_shape, num_classes, dim, self.num_layers, self.num_heads)


@dataclass
class LSTM(Embedding):
    choice = "lstm"
    hidden_dim: int = checked(256, lambda v: v >= 1, "an integer >= 1", "lstm: LSTM hidden units (LEAF's 256)")

    def network(self, input_shape: tuple[int, ...], num_classes: int, vocab_size: Optional[int]) -> BodyHeadModel:
        from plfl.models.networks import lstm

        return lstm(input_shape, num_classes, vocab_size, self.embedding_dim or 8, self.hidden_dim)


def models() -> dict[str, type[Model]]:
    """``model.name`` → its :class:`Model`."""
    return registry(Model)


ModelConfig = section(
    "ModelConfig",
    __name__,
    Model,
    models().values(),
    "The network (``model.*``): the keys of every model; a run's config sets those of its model (:mod:`plfl.config` "
    "refuses the others). Input shape and class count come from the data.",
)


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, vocab_size: Optional[int] = None, **keys: Any
) -> BodyHeadModel:
    """Model ``name`` with its ``keys`` (the others at their defaults) for the data's ``input_shape`` (no batch
    dim), ``num_classes`` and, for text, ``vocab_size``.

    Raises:
        ConfigError: an unknown name, or inputs the network cannot take.
        TypeError: a key the model does not read.
    """
    if name not in models():
        raise ConfigError(f"Unknown model.name {name!r}; valid names: {', '.join(models())}.")
    return models()[name](name=name, **keys).build(input_shape, num_classes, vocab_size)


def __getattr__(name: str) -> Any:
    # The network classes import torch: only when asked for.
    if name in ("BodyHeadModel", "channels_last"):
        from plfl.models import networks

        return getattr(networks, name)
    raise AttributeError(f"module 'plfl.models' has no attribute {name!r}")
