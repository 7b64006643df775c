"""Seeds derived from (run seed, round, client, stream): independent of execution order.

Every random draw of a federation (client sampling, batch shuffling, ALA's
data subsets, hypernetwork initialisation) comes from a generator seeded by
:func:`derive_seed`, so none of them carries state from one round to the
next; the global RNGs are captured in checkpoints all the same
(:func:`global_rng_state`) for code outside plfl that draws from them
(e.g. dropout).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

from plfl.errors import ConfigError

# The streams numbered before streams were named, in the order of their numbers (0, 1, ...): a stream of this
# list keeps its number, and so every run keeps its draws. Any other name is a stream of its own
# (:func:`stream_number`); a method names its streams where it draws from them.
NUMBERED_STREAMS = (
    "sampling",
    "local_training",
    "ala_subset",
    "post_training",
    "hypernetwork_init",
    "shuffling",
    "fine_tuning",
    "personal_training",
    "adaptation",
    "head_training",
    "augmentation",
    "validation_split",
    "partial_strategy",
)


def stream_number(stream: str) -> int:
    """The number of the random stream named ``stream``: its place in :data:`NUMBERED_STREAMS`, else 2^63 plus
    the first 63 bits of the name's SHA-256 (never one of the numbered ones)."""
    if stream in NUMBERED_STREAMS:
        return NUMBERED_STREAMS.index(stream)
    digest = int.from_bytes(hashlib.sha256(stream.encode()).digest()[:8], "big")
    return 1 << 63 | digest >> 1


def derive_seed(seed: int, round_: int, client_id: int, stream: str) -> int:
    """A 63-bit seed for the random stream named ``stream`` (e.g. ``"local_training"``, ``"ala_subset"``) of
    ``client_id`` in ``round_`` of a run seeded with ``seed``: streams are independent of each other and of the
    order in which they are drawn, so that e.g. adding ALA does not shift the client sampling."""
    state = np.random.SeedSequence([seed, round_, client_id + 1, stream_number(stream)]).generate_state(2, np.uint32)
    return int(state[0]) << 31 ^ int(state[1])


def sample_clients(seed: int, round_: int, num_clients: int, join_ratio: float) -> list[int]:
    """The ids of the :func:`clients_per_round` clients that train in ``round_``, sorted."""
    rng = np.random.default_rng(derive_seed(seed, round_, -1, "sampling"))
    return sorted(rng.choice(num_clients, size=clients_per_round(num_clients, join_ratio), replace=False).tolist())


def unseen_clients(seed: int, num_clients: int, unseen: float) -> list[int]:
    """The ids of the clients held out of training (``federation.unseen_clients``), sorted: ``unseen`` of the
    ``num_clients`` when it is 1 or more, else a fraction of them, ``round(unseen · num_clients)`` and at least 1
    (none for 0); drawn from the stream ``"unseen_clients"`` of ``seed``.

    Raises:
        ConfigError: that leaves fewer than one client to train.
    """
    count = 0 if unseen == 0 else int(unseen) if unseen >= 1 else max(1, round(unseen * num_clients))
    if count >= num_clients:
        raise ConfigError(
            f"federation.unseen_clients={unseen} holds out {count} of the {num_clients} clients and leaves none to "
            f"train; hold out fewer (at most {num_clients - 1}, or a fraction below 1)."
        )
    rng = np.random.default_rng(derive_seed(seed, 0, -1, "unseen_clients"))
    return sorted(rng.choice(num_clients, size=count, replace=False).tolist())


def malicious_clients(seed: int, num_clients: int, fraction: float) -> frozenset[int]:
    """The ids of the malicious clients (``attack.fraction``): ``round(fraction · num_clients)`` of the
    ``num_clients``, at least 1 when ``fraction`` > 0 (none for 0), drawn from the stream ``"malicious_clients"``
    of ``seed``."""
    count = 0 if fraction == 0 else max(1, round(fraction * num_clients))
    rng = np.random.default_rng(derive_seed(seed, 0, -1, "malicious_clients"))
    return frozenset(rng.choice(num_clients, size=count, replace=False).tolist())


def clients_per_round(num_clients: int, join_ratio: float) -> int:
    """How many clients train in a round: ``max(1, int(join_ratio · num_clients))``."""
    return max(1, int(join_ratio * num_clients))


def global_rng_state() -> dict[str, Any]:
    """The states of Python's, NumPy's and torch's global RNGs (CUDA's too when present), as plain
    types and tensors that ``torch.load(weights_only=True)`` reads back."""
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {
            **numpy_state,
            "state": {
                "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                "pos": numpy_state["state"]["pos"],
            },
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_global_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`global_rng_state` captured."""
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            **numpy_state,
            "state": {"key": numpy_state["state"]["key"].numpy().astype(np.uint32), "pos": numpy_state["state"]["pos"]},
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
