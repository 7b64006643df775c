"""Seeds derived from (run seed, round, client, stream): independent of execution order."""

from __future__ import annotations

import numpy as np

# One stream per kind of randomness, so that e.g. adding ALA does not shift the sampling.
SAMPLING, LOCAL_TRAINING, ALA_SUBSET, POST_TRAINING, HYPERNETWORK_INIT = range(5)


def derive_seed(seed: int, round_: int, client_id: int, stream: int) -> int:
    """A 63-bit seed for ``stream`` of ``client_id`` in ``round_`` of a run seeded with ``seed``."""
    state = np.random.SeedSequence([seed, round_, client_id + 1, stream]).generate_state(2, np.uint32)
    return int(state[0]) << 31 ^ int(state[1])


def sample_clients(seed: int, round_: int, num_clients: int, join_ratio: float) -> list[int]:
    """The ids of the ``max(1, int(join_ratio · num_clients))`` clients that train in ``round_``, sorted."""
    count = max(1, int(join_ratio * num_clients))
    rng = np.random.default_rng(derive_seed(seed, round_, -1, SAMPLING))
    return sorted(rng.choice(num_clients, size=count, replace=False).tolist())
