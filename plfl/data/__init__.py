"""Federated data: sources, partitioners and the per-client tensors plfl trains on."""

from plfl.data.federated import ClientData, FederatedData
from plfl.data.sources import load_federated_data

__all__ = ["ClientData", "FederatedData", "load_federated_data"]
