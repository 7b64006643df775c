"""Federated data: sources, partitioners and the per-client tensors plfl trains on.

:func:`load_federated_data` is imported on first use: the readers pull in scikit-learn, PIL and
tokenizers, which code that only needs the tensor types (methods, models) does without.
"""

from typing import Any

from plfl.data.federated import ClientData, FederatedData

__all__ = ["ClientData", "FederatedData", "load_federated_data"]


def __getattr__(name: str) -> Any:
    if name == "load_federated_data":
        from plfl.data.sources import load_federated_data

        return load_federated_data
    raise AttributeError(f"module 'plfl.data' has no attribute {name!r}")
