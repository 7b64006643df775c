"""Simulated client systems (``federation.system.*``): how long a client's round takes, who drops out, and who
misses the round's deadline.

A participating client ``i`` has a profile: seconds per training sample ``c_i``, a latency ``ℓ_i`` (seconds per
message) and a bandwidth ``b_i`` (bytes per second; unlimited when null). Drawn once per run from the seed
(stream ``"system_profile"``), log-normal with medians ``sample_seconds``, ``latency`` and ``bandwidth`` and
log-std ``compute_spread`` (compute) and ``network_spread`` (latency, and bandwidth inversely: a slow link is
slow both ways), or read from a ``trace`` CSV. Client ``i``'s round, from the broadcast, takes

    t_i = (ℓ_i + down_i / b_i) + s_i · c_i + (ℓ_i + up_i / b_i),

``down_i`` and ``up_i`` the bytes it receives and sends and ``s_i`` the training samples it processes (every
training task and method step of its round: ``samples_seen``). A sampled client drops out with probability
``dropout`` (stream ``"dropout"`` of the round and client) and does no work. With a ``deadline`` D, a client whose
t_i would exceed D is late: with ``late=drop`` its round's work is discarded; with ``late=partial`` its training is
cut to the samples that fit, D − 2ℓ_i − 2·down_i/b_i seconds of compute (the upload taken as large as the
download), FedProx's partial work (Li et al., MLSys 2020, Sec. 3.2: a straggler's γ-inexact solution). A task is
cut to whole mini-batches; a client left no batch for a task is late. The round's simulated time is the latest
accepted arrival, or D when a sampled client dropped out or was late (the server waits for it until then).
Every draw is stateless, so a resumed run simulates what an uninterrupted one does.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from plfl.errors import ConfigError
from plfl.sections import SystemConfig
from plfl.seeding import derive_seed
from plfl.tasks import StepResult, StepTask, TrainResult, TrainTask, Work

TRACE_COLUMNS = ("client", "sample_seconds", "latency", "bandwidth")


@dataclasses.dataclass(frozen=True)
class ClientProfile:
    """One client's simulated system: seconds per training sample, seconds per message, bytes per second
    (None: unlimited)."""

    sample_seconds: float
    latency: float
    bandwidth: Optional[float]

    def transfer(self, nbytes: int) -> float:
        """Seconds one message of ``nbytes`` bytes takes: latency plus bytes over bandwidth."""
        return self.latency + (nbytes / self.bandwidth if self.bandwidth else 0.0)


def client_profiles(config: SystemConfig, num_clients: int, seed: int) -> list[ClientProfile]:
    """Every participating client's profile: from ``config.trace``, else drawn (see the module docstring).

    Raises:
        ConfigError: a deadline without simulated time, or a trace that is missing, malformed, or does not give
            every client 0..num_clients−1 exactly one row (the message names the file and the fix).
    """
    if config.deadline is not None and not config.simulated:
        raise ConfigError(
            f"federation.system.deadline={config.deadline} needs simulated times: set "
            "federation.system.sample_seconds (seconds per training sample) or federation.system.trace."
        )
    if config.trace is not None:
        return read_trace(Path(config.trace), num_clients)
    profiles = []
    for client in range(num_clients):
        z_compute, z_network = np.random.default_rng(derive_seed(seed, 0, client, "system_profile")).standard_normal(2)
        network = math.exp(config.network_spread * z_network)
        profiles.append(
            ClientProfile(
                (config.sample_seconds or 0.0) * math.exp(config.compute_spread * z_compute),
                config.latency * network,
                None if config.bandwidth is None else config.bandwidth / network,
            )
        )
    return profiles


def read_trace(path: Path, num_clients: int) -> list[ClientProfile]:
    """The profiles of a trace CSV (columns :data:`TRACE_COLUMNS`, one row per client 0..num_clients−1, an
    empty bandwidth for an unlimited link), in client order.

    Raises:
        ConfigError: the file is missing or unreadable, a column is missing, a value is not a number ≥ 0
            (bandwidth > 0), or a client has no row or several.
    """
    fix = (
        f"Give federation.system.trace a CSV with columns {', '.join(TRACE_COLUMNS)} and one row per client "
        f"0..{num_clients - 1}."
    )
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise ConfigError(f"Cannot read the system trace {path}: {error}. {fix}") from None
    missing = [c for c in TRACE_COLUMNS if rows and c not in rows[0]]
    if not rows or missing:
        raise ConfigError(f"The system trace {path} has {'no rows' if not rows else f'no column {missing[0]}'}. {fix}")
    profiles: dict[int, ClientProfile] = {}
    for line, row in enumerate(rows, start=2):
        try:
            client = int(row["client"])
            values = [float(row[c]) for c in ("sample_seconds", "latency")]
            bandwidth = float(row["bandwidth"]) if row["bandwidth"].strip() else None
        except (AttributeError, TypeError, ValueError):
            raise ConfigError(
                f"The system trace {path}, line {line}: {row} holds a value that is not a number. {fix}"
            ) from None
        if min(values) < 0 or (bandwidth is not None and bandwidth <= 0) or not all(map(math.isfinite, values)):
            raise ConfigError(
                f"The system trace {path}, line {line}: times must be finite and >= 0, bandwidth > 0. {fix}"
            )
        if client in profiles or not 0 <= client < num_clients:
            raise ConfigError(
                f"The system trace {path}, line {line}: client {client} is repeated or out of range. {fix}"
            )
        profiles[client] = ClientProfile(values[0], values[1], bandwidth)
    if len(profiles) < num_clients:
        absent = min(set(range(num_clients)) - set(profiles))
        raise ConfigError(f"The system trace {path} has no row for client {absent}. {fix}")
    return [profiles[i] for i in range(num_clients)]


class SystemSimulation:
    """The federation's simulated clients: who drops out, how much work a client may do before the deadline, and
    when its upload arrives (see the module docstring). ``num_train``: each client's training samples."""

    def __init__(self, config: SystemConfig, num_train: list[int], batch_size: int, seed: int):
        self.config = config
        self.profiles = client_profiles(config, len(num_train), seed)
        self.num_train = num_train
        self.batch_size = batch_size
        self.seed = seed

    def drops_out(self, client_id: int, round_: int) -> bool:
        """Whether the sampled client drops out of ``round_`` (probability ``dropout``)."""
        if not self.config.dropout:
            return False
        return (
            np.random.default_rng(derive_seed(self.seed, round_, client_id, "dropout")).random() < self.config.dropout
        )

    def budget(self, client_id: int, down: int) -> Optional[float]:
        """Training samples the client may process before the deadline when late clients send partial work, its
        download taking ``down`` bytes and its upload as many; None: no limit."""
        if self.config.deadline is None or self.config.late != "partial":
            return None
        profile = self.profiles[client_id]
        compute = self.config.deadline - 2 * profile.transfer(down)
        return math.inf if profile.sample_seconds == 0 else max(compute, 0.0) / profile.sample_seconds

    def arrival(self, client_id: int, down: int, samples: int, up: int) -> float:
        """Simulated seconds from the broadcast until the client's upload of ``up`` bytes arrives."""
        profile = self.profiles[client_id]
        return profile.transfer(down) + samples * profile.sample_seconds + profile.transfer(up)

    def late(self, arrival: float) -> bool:
        return self.config.deadline is not None and arrival > self.config.deadline

    def round_seconds(self, arrivals: list[float], missing: bool) -> float:
        """The round's simulated seconds: the latest of the accepted ``arrivals``, or the deadline when a sampled
        client is ``missing`` (dropped out or late) and there is one."""
        if missing and self.config.deadline is not None:
            return self.config.deadline
        return max(arrivals, default=0.0)

    def metered(self, client_id: int, work: Work[Any], budget: Optional[float]) -> Work[tuple[Any, int, bool]]:
        """``work`` (a client's round) run with its training tasks cut to ``budget`` samples in all (None: not
        cut); returns its value, the training samples it processed, and whether a task was cut. The value is
        None, and ``work`` closed, when a training task would be left no mini-batch: the client is late."""
        processed, planned, cut_any, result = 0, 0.0, False, None
        while True:
            try:
                request = work.send(result)
            except StopIteration as stop:
                return stop.value, processed, cut_any
            cut = []
            for task in request if isinstance(request, list) else [request]:
                left = None if budget is None else budget - planned
                shortened, samples = self._cut(client_id, task, left)
                if shortened is None:
                    work.close()
                    return None, processed, True
                cut_any = cut_any or shortened is not task
                cut.append(shortened)
                planned += samples
            result = yield cut if isinstance(request, list) else cut[0]
            processed += sum(
                r.samples_seen
                for r in (result if isinstance(request, list) else [result])
                if isinstance(r, (TrainResult, StepResult))
            )
            planned = processed

    def _cut(self, client_id: int, task: Any, left: Optional[float]) -> tuple[Any, float]:
        """``task`` cut to the whole mini-batches that ``left`` samples allow (None: all of it), and the samples
        it will process; the task is None when ``left`` does not hold one mini-batch."""
        if not isinstance(task, (TrainTask, StepTask)):
            return task, 0.0
        batch = task.batch_size if isinstance(task, StepTask) else self.batch_size
        n = self._samples(client_id, task)
        steps = task.steps if task.steps is not None else task.epochs * math.ceil(n / batch)
        if left is None or steps * batch <= left:
            return task, float(steps * batch)
        allowed = int(left // batch)
        if allowed < 1:
            return None, 0.0
        return dataclasses.replace(task, epochs=None, steps=allowed), float(allowed * batch)

    def _samples(self, client_id: int, task: Union[TrainTask, StepTask]) -> int:
        """The samples one epoch of ``task`` goes over."""
        if isinstance(task, StepTask):
            if task.data is not None:
                return len(task.data[1])
            if task.ordered_samples is not None:
                return len(task.ordered_samples)
        elif task.samples is not None:
            return len(task.samples)
        return self.num_train[client_id]
