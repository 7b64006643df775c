"""Networks with an explicit body (representation) and head (last classifier layer)."""

from plfl.models.networks import BodyHeadModel, build_model

__all__ = ["BodyHeadModel", "build_model"]
