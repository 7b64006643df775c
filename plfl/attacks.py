"""Poisoned clients (``attack.*``): which clients are malicious, and what they do to their data or their message.

The malicious clients are ``attack.fraction`` of the participating clients, drawn once from the run's seed
(:func:`plfl.seeding.malicious_clients`), so the same seed gives the same clients on every executor and after a
resume. Label flipping changes their training labels once, when the federation's data is built
(:func:`flip_labels`); the model attacks change their upload after ``client_message``
(:meth:`Attack.message`), with u = θ_i − θ_sent their update from the model they received:

- ``sign_flip``: θ_sent − λu (the update reversed and scaled);
- ``scale``: θ_sent + λu (model replacement's boosting; Bagdasaryan et al., AISTATS 2020);
- ``gaussian``: θ_sent + ε, ε ~ N(0, σ²) per scalar, drawn from (seed, round, client, stream "attack_noise").

A backdoor (BadNets' trigger, Gu et al., 2017, in federated form as Bagdasaryan et al., AISTATS 2020, test it)
is data poisoning: a share of each malicious client's training images carry a trigger patch and the target
label (:func:`plant_backdoor`), once, when the data is built. Its success is measured on every client's test
images of the other classes with the trigger (:func:`triggered_test_clients`): the share its model predicts as
the target (``backdoor_success``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from plfl.data.federated import ClientData, FederatedData
from plfl.errors import ConfigError
from plfl.sections import AttackConfig
from plfl.seeding import derive_seed
from plfl.state import Params

MODEL_ATTACKS = ("sign_flip", "scale", "gaussian")
TRIGGER = 3  # the side of the trigger's square patch, in pixels


def with_trigger(x: torch.Tensor, peak: float) -> torch.Tensor:
    """A copy of the images ``x`` (n, C, H, W) with the trigger: the bottom-right ``TRIGGER`` × ``TRIGGER`` patch
    of every channel set to ``peak`` (the data's largest value: a white square)."""
    triggered = x.clone()
    triggered[..., -TRIGGER:, -TRIGGER:] = peak
    return triggered


def trigger_peak(data: FederatedData) -> float:
    """The trigger's value: the largest value of ``data``'s training images."""
    return max(c.x_train.max().item() for c in data.clients if c.num_train)


def check_images(data: FederatedData, target: int) -> None:
    """Refuse a backdoor on data that are not images (n, C, H, W) at least the trigger's size, or a target that is
    not one of the classes.

    Raises:
        ConfigError: naming the problem and the fix.
    """
    shape = data.input_shape
    if data.vocab_size is not None or len(shape) != 3 or min(shape[1:]) < TRIGGER:
        raise ConfigError(
            f"attack.kind=backdoor puts a {TRIGGER}×{TRIGGER} trigger patch on images (C, H, W), but "
            f"{data.name}'s inputs have shape {tuple(shape)}. Choose an image data source, or another attack.kind."
        )
    if target >= data.num_classes:
        raise ConfigError(
            f"attack.target={target} is not a class of {data.name}, whose classes are 0..{data.num_classes - 1}; "
            "set attack.target to one of them."
        )


def plant_backdoor(data: FederatedData, malicious: frozenset[int], config: AttackConfig, seed: int) -> FederatedData:
    """``data`` with ``attack.poison_fraction`` of each ``malicious`` client's training images (rounded, at least
    one; drawn from (seed, client, stream "backdoor_samples")) triggered (:func:`with_trigger` with
    :func:`trigger_peak`) and relabelled to ``attack.target``; everything else as it is."""
    peak = trigger_peak(data)
    clients = list(data.clients)
    for i in sorted(malicious):
        client = clients[i]
        count = max(1, round(config.poison_fraction * client.num_train))
        generator = torch.Generator().manual_seed(derive_seed(seed, 0, i, "backdoor_samples"))
        chosen = torch.randperm(client.num_train, generator=generator)[:count]
        x, y = client.x_train.clone(), client.y_train.clone()
        x[chosen], y[chosen] = with_trigger(x[chosen], peak), config.target
        clients[i] = dataclasses.replace(client, x_train=x, y_train=y)
    return dataclasses.replace(data, clients=clients)


def triggered_test_clients(data: FederatedData, target: int) -> list[ClientData]:
    """Per client of ``data``, a client whose test split is its test images of the classes other than ``target``
    with the trigger, all labelled ``target`` (its accuracy there: the backdoor's success), and no training
    samples; the trigger's value is :func:`trigger_peak` of ``data``, as :func:`plant_backdoor` takes it."""
    peak = trigger_peak(data)
    triggered = []
    for client in data.clients:
        others = client.y_test != target
        x_test = with_trigger(client.x_test[others], peak)
        triggered.append(
            ClientData(
                client.x_train.new_empty((0, *client.x_train.shape[1:])),
                client.y_train.new_empty((0,)),
                x_test,
                torch.full((len(x_test),), target, dtype=client.y_test.dtype),
            )
        )
    return triggered


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
    """Refuse a model attack on ``method`` when its upload is not a model (``uploads_model`` false: prototypes,
    control variates, Fisher traces, or nothing).

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
