"""Class prototypes: the mean representation of each class, as FedProto and FedPAC send them instead of models.

A prototype travels in a message as ``prototype/<k>``, an (F,) tensor for class k, F the body's output size. A
client's prototype of class k is the mean body output of its training samples of class k
(:func:`local_prototypes` of :func:`class_sums`); the server's global prototype of class k is the plain mean of
the uploaded ones over the clients that hold class k (:func:`aggregate_prototypes`); a client's features are
pulled to their class's global prototype by :func:`prototype_penalty`. Everything here is a torch function of
tensors; the per-batch functions take a padding mask and have no data-dependent shapes, so the vectorized
executor runs them under ``vmap``.
"""

from __future__ import annotations

from typing import Optional

import torch

from plfl.state import Params

PREFIX = "prototype/"  # a message's prototype of class k: prototype/<k>, (F,)


def one_hot(y: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    """(B,) int64 labels → (B, num_classes) 1/0 rows of ``dtype``."""
    return (y[:, None] == torch.arange(num_classes, device=y.device)).to(dtype)


def class_sums(
    features: torch.Tensor, y: torch.Tensor, num_classes: int, mask: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class sums of the features (B, F) of the samples with labels ``y`` (B,) and the samples counted (the
    real ones where ``mask`` (B,) is 1): (num_classes, F) and (num_classes,), in the features' dtype."""
    rows = one_hot(y, num_classes, features.dtype)
    if mask is not None:
        rows = rows * mask[:, None]
    return rows.T @ features, rows.sum(0)


def local_prototypes(sums: torch.Tensor, counts: torch.Tensor) -> Params:
    """sums[k] / counts[k] for every class k with counts[k] > 0, as ``prototype/<k>`` (F,) tensors: what a
    client uploads. ``sums`` (C, F), ``counts`` (C,), as :func:`class_sums` returns them."""
    return {f"{PREFIX}{k}": sums[k] / counts[k] for k in range(len(counts)) if counts[k] > 0}


def aggregate_prototypes(uploads: list[Params]) -> Params:
    """The global prototype of every class k that some upload holds: the plain mean of the uploaded
    ``prototype/<k>`` over the uploads that hold it; classes nobody uploaded have none."""
    keys = sorted({k for upload in uploads for k in upload}, key=lambda k: int(k.removeprefix(PREFIX)))
    return {k: torch.stack([u[k] for u in uploads if k in u]).mean(0) for k in keys}


def prototype_table(prototypes: Params, num_classes: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``prototype/<k>`` tensors as a (num_classes, dim) table, zero rows where a class has none, and
    (num_classes,) 1/0 flags of the classes that have one (float32, or the prototypes' dtype)."""
    dtype = next(iter(prototypes.values())).dtype if prototypes else torch.float32
    table, present = torch.zeros(num_classes, dim, dtype=dtype), torch.zeros(num_classes, dtype=dtype)
    for key, prototype in prototypes.items():
        k = int(key.removeprefix(PREFIX))
        table[k], present[k] = prototype, 1
    return table, present


def prototype_penalty(
    features: torch.Tensor, y: torch.Tensor, table: torch.Tensor, present: torch.Tensor, mask: Optional[torch.Tensor]
) -> torch.Tensor:
    """Σ_b m_b p_{y_b} ‖z_b − c_{y_b}‖² / (F Σ_b m_b): the mean squared error between the features and their
    class's global prototype over the real samples and the F dimensions (PFLlib's ``MSELoss`` in FedProto and
    FedPAC), a sample whose class has no prototype (p = 0) counting 0.

    Args:
        features: (B, F) body outputs z.
        y: (B,) int64 labels.
        table: (C, F) global prototypes c (rows of classes without one unused).
        present: (C,) 1/0, the classes with a global prototype.
        mask: (B,) 1/0 real samples, or None (all).

    Returns:
        A 0-dim tensor.
    """
    rows = one_hot(y, table.shape[0], features.dtype)
    weight = rows @ present if mask is None else (rows @ present) * mask
    squared = (features - rows @ table).square().sum(1)
    samples = features.shape[0] if mask is None else mask.sum()
    return (weight * squared).sum() / (features.shape[1] * samples)
