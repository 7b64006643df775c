"""Federated data: sources, partitioners and the per-client tensors plfl trains on."""

from plfl.data.sources import ClientData, FederatedData, load_federated_data

__all__ = ["ClientData", "FederatedData", "load_federated_data"]
