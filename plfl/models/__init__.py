"""Networks with an explicit body (representation) and head (last classifier layer)."""

from plfl.models.networks import MODELS, BodyHeadModel, build_model, channels_last

__all__ = ["MODELS", "BodyHeadModel", "build_model", "channels_last"]
