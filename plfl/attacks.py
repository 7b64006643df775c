"""Poisoned clients (``attack.*``): which clients are malicious, and what they do to their data or their message.

The malicious clients are ``attack.fraction`` of the participating clients, drawn once from the run's seed
(:func:`plfl.seeding.malicious_clients`), so the same seed gives the same clients on every executor and after a
resume. Label flipping changes their training labels once, when the federation's data is built
(:func:`flip_labels`); the model attacks change their upload after ``client_message``
(:meth:`Attack.message`), with u = θ_i − θ_sent their update from the model they received:

- ``sign_flip``: θ_sent − λu (the update reversed and scaled);
- ``scale``: θ_sent + λu (model replacement's boosting; Bagdasaryan et al., AISTATS 2020);
- ``gaussian``: θ_sent + ε, ε ~ N(0, σ²) per scalar, drawn from (seed, round, client, stream "attack_noise").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from plfl.data.federated import FederatedData
from plfl.errors import ConfigError
from plfl.sections import AttackConfig
from plfl.seeding import derive_seed
from plfl.state import Params

MODEL_ATTACKS = ("sign_flip", "scale", "gaussian")


def flip_labels(data: FederatedData, malicious: frozenset[int]) -> FederatedData:
    """``data`` with the training labels of the ``malicious`` clients flipped, y → C − 1 − y (C:
    ``data.num_classes``); their validation and test splits and every other client are left as they are."""
    clients = [
        dataclasses.replace(c, y_train=data.num_classes - 1 - c.y_train) if i in malicious else c
        for i, c in enumerate(data.clients)
    ]
    return dataclasses.replace(data, clients=clients)


def sign_flipped(message: Params, sent: Params, scale: float) -> Params:
    """θ_sent − λ(θ_i − θ_sent) for every floating-point tensor of ``message`` (λ: ``scale``); others unchanged."""
    return _on_floats(message, lambda key, value: sent[key] - scale * (value - sent[key]))


def scaled(message: Params, sent: Params, scale: float) -> Params:
    """θ_sent + λ(θ_i − θ_sent) for every floating-point tensor of ``message`` (λ: ``scale``); others unchanged."""
    return _on_floats(message, lambda key, value: sent[key] + scale * (value - sent[key]))


def gaussian(message: Params, sent: Params, std: float, seed: int) -> Params:
    """θ_sent + ε for every floating-point tensor of ``message``, ε ~ N(0, σ²) per scalar (σ: ``std``), drawn in
    the message's key order from a CPU generator seeded with ``seed``; others unchanged."""
    generator = torch.Generator().manual_seed(seed)

    def noisy(key: str, value: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(value.shape, generator=generator, dtype=value.dtype) * std
        return sent[key] + noise.to(value.device)

    return _on_floats(message, noisy)


def check_attack(config: AttackConfig, method: str, uploads_model: bool) -> None:
    """Refuse a model attack on ``method`` when its upload is not a model (``uploads_model`` false: prototypes).

    Raises:
        ConfigError: naming the method, why, and the fix.
    """
    if config.kind in MODEL_ATTACKS and not uploads_model:
        raise ConfigError(_not_a_model(config.kind, method))


@dataclass(frozen=True)
class Attack:
    """The run's attack: ``config`` (``attack.*``) carried out by the ``malicious`` clients of a run seeded with
    ``seed``."""

    config: AttackConfig
    malicious: frozenset[int]
    seed: int

    def message(
        self, method: str, client_id: int, message: Optional[Params], sent: Optional[Params], round_: int
    ) -> Optional[Params]:
        """What client ``client_id`` uploads in ``round_``: ``message`` (what ``method``'s ``client_message``
        made), changed by a model attack if the client is malicious; ``sent``: the model it received.

        Raises:
            ConfigError: a model attack on a message that is not a model beside the received one (another key, or
                another shape, or nothing sent).
        """
        kind = self.config.kind
        if kind not in MODEL_ATTACKS or client_id not in self.malicious:
            return message
        if (
            message is None
            or sent is None
            or any(v.is_floating_point() and (k not in sent or sent[k].shape != v.shape) for k, v in message.items())
        ):
            raise ConfigError(_not_a_model(kind, method))
        if kind == "sign_flip":
            return sign_flipped(message, sent, self.config.scale)
        if kind == "scale":
            return scaled(message, sent, self.config.scale)
        noise_seed = derive_seed(self.seed, round_, client_id, "attack_noise")
        return gaussian(message, sent, self.config.noise_std, noise_seed)


def _not_a_model(kind: str, method: str) -> str:
    return (
        f"attack.kind={kind} changes a client's model update θ_i − θ_sent, but {method}'s upload is not a model "
        "beside the one its clients receive (it sends other tensors, or nothing). Set attack.kind=label_flip, "
        "which works for every method, or attack a method that uploads models."
    )


def _on_floats(message: Params, change) -> Params:
    return {k: change(k, v) if v.is_floating_point() else v for k, v in message.items()}
