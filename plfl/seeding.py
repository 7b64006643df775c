"""Seeds derived from (run seed, round, client, stream): independent of execution order.

Every random draw of a federation (client sampling, batch shuffling, ALA's
data subsets, hypernetwork initialisation) comes from a generator seeded by
:func:`derive_seed`, so none of them carries state from one round to the
next; the global RNGs are captured in checkpoints all the same
(:func:`global_rng_state`) for code outside plfl that draws from them
(e.g. dropout).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

# One stream per kind of randomness, so that e.g. adding ALA does not shift the sampling.
SAMPLING, LOCAL_TRAINING, ALA_SUBSET, POST_TRAINING, HYPERNETWORK_INIT, SHUFFLING = range(6)
# Second trainings of a client in a round: fine-tuning the received model (FedAvg-C), a personal
# model beside the global one (Ditto, pFedMe), adaptation before evaluation (Per-FedAvg), head
# epochs before body epochs (FedRep).
FINE_TUNING, PERSONAL_TRAINING, ADAPTATION, HEAD_TRAINING = range(6, 10)
# Per-sample data augmentation within one training (drawn from that training's seed).
AUGMENTATION = 10
# A validation split held out of a client's training split once per run (FedFomo).
VALIDATION_SPLIT = 11
# PartialFed-Adaptive's Gumbel noise and held-back samples of one participation.
PARTIAL_STRATEGY = 12


def derive_seed(seed: int, round_: int, client_id: int, stream: int) -> int:
    """A 63-bit seed for ``stream`` of ``client_id`` in ``round_`` of a run seeded with ``seed``."""
    state = np.random.SeedSequence([seed, round_, client_id + 1, stream]).generate_state(2, np.uint32)
    return int(state[0]) << 31 ^ int(state[1])


def sample_clients(seed: int, round_: int, num_clients: int, join_ratio: float) -> list[int]:
    """The ids of the :func:`clients_per_round` clients that train in ``round_``, sorted."""
    rng = np.random.default_rng(derive_seed(seed, round_, -1, SAMPLING))
    return sorted(rng.choice(num_clients, size=clients_per_round(num_clients, join_ratio), replace=False).tolist())


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
