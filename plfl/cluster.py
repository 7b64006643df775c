"""Ray, the optional engine of ``federation.executor=ray`` and ``plfl sweep --parallel``: importing it with the
install command, and connecting to a cluster (or starting one on this machine) with errors that name the fix.

Nothing here imports torch. Ray's own documentation: https://docs.ray.io/en/latest/ray-core/starting-ray.html
"""

from __future__ import annotations

import math
import signal
import socket
import threading
from types import ModuleType
from urllib.parse import urlsplit

from plfl.errors import ConfigError
from plfl.stopping import deferred

INSTALL = "pip install -e '.[ray]' (in a clone of plfl; elsewhere pip install 'ray>=2.55')"


def import_ray(needed_by: str) -> ModuleType:
    """The ``ray`` package.

    Raises:
        ConfigError: Ray is not installed; the message names ``needed_by`` (e.g. ``federation.executor=ray``)
            and the install command.
    """
    try:
        import ray
    except ImportError:
        raise ConfigError(f"{needed_by} runs on Ray, which is not installed. Install it with {INSTALL}.") from None
    return ray


def connect(ray: ModuleType, address: str, num_cpus: float) -> bool:
    """Connect this process to Ray at ``address`` unless it is connected already; returns whether it connected
    (then the caller disconnects with ``ray.shutdown()`` when done).

    Args:
        ray: the ``ray`` package (:func:`import_ray`).
        address: ``local`` starts Ray on this machine with ``num_cpus`` CPUs (rounded up) and its GPUs;
            ``auto`` joins the cluster this machine belongs to (``ray start``); ``host:port`` a cluster's head
            (GCS port, 6379 by default); ``ray://host:port`` a remote cluster through Ray Client (10001 by
            default; needs ``pip install 'ray[client]'``).
        num_cpus: CPUs of a local Ray (ignored for a cluster, which has its own).

    Raises:
        ConfigError: the address cannot be reached, or Ray refuses to connect (its message is included).
    """
    if ray.is_initialized():
        return False
    if address not in ("local", "auto"):
        _check_reachable(address)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        if address == "local":
            ray.init(address="local", num_cpus=math.ceil(num_cpus), include_dashboard=False)
        else:
            ray.init(address=address)
    except Exception as error:  # noqa: BLE001  Ray raises ConnectionError, RuntimeError, ValueError ...
        raise ConfigError(
            f"Could not connect to Ray at ray.address={address}: {type(error).__name__}: {error}. {_FIX}"
        ) from None
    finally:
        # ray.init replaces the driver's SIGTERM handler with sys.exit: keep the process's own (plfl.stopping).
        if sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, sigterm)
    return True


def wait(ray: ModuleType, refs: list, count: int = 1) -> list:
    """The first ``count`` of ``refs`` to finish, their values taken (``ray.get``), in ``refs``' order.

    Ray's waits run in its C++ core, which cannot pass on an exception raised by a Python signal handler
    (it turns it into ``SystemError``); so this waits in half-second pieces, each shielded from a stopping
    signal (:func:`plfl.stopping.deferred`), which takes effect between them.

    Returns:
        (ref, value) pairs. A ref whose task raised gives the exception instead of a value (RayActorError,
        RayTaskError ...).
    """
    while True:
        with deferred():
            ready, _ = ray.wait(refs, num_returns=count, timeout=0.5)
        if len(ready) >= count:
            break
    done = []
    for ref in (r for r in refs if r in ready):
        with deferred():
            try:
                done.append((ref, ray.get(ref)))
            except Exception as error:  # noqa: BLE001  the caller decides per task
                done.append((ref, error))
    return done


_FIX = (
    "Start a cluster with `ray start --head` and pass its address (ray.address=auto on one of its machines, "
    "ray://HEAD:10001 elsewhere), or set ray.address=local to start Ray on this machine."
)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a ``host:port`` nobody listens on: Ray itself retries such an address for minutes."""
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        host, port = parts.hostname, parts.port or (10001 if parts.scheme == "ray" else None)
    except ValueError:  # a port that is not a number
        host, port = None, None
    if not host or not port:
        raise ConfigError(f"ray.address={address} is not local, auto, host:port or ray://host:port. {_FIX}")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        raise ConfigError(f"Could not reach the Ray cluster at ray.address={address} ({error}). {_FIX}") from None
