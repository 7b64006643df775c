"""Federated data: sources, partitioners and the per-client tensors plfl trains on.

The sources and partitions (:mod:`plfl.data.sources`, :mod:`plfl.data.partition`) are plain declarations that a
config is checked against; the tensor types and :func:`load_federated_data` are imported on first use: they and
the readers pull in torch, scikit-learn, PIL and tokenizers.
"""

from typing import Any

__all__ = ["ClientData", "FederatedData", "load_federated_data"]


def __getattr__(name: str) -> Any:
    if name in ("ClientData", "FederatedData"):
        from plfl.data import federated

        return getattr(federated, name)
    if name == "load_federated_data":
        from plfl.data.loading import load_federated_data

        return load_federated_data
    raise AttributeError(f"module 'plfl.data' has no attribute {name!r}")
