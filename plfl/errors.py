"""Errors that plfl reports to the user as a one-paragraph message (no traceback)."""


class PlflError(Exception):
    """A failure caused by the user's input or environment; the message names the fix."""


class ConfigError(PlflError):
    """The experiment configuration is malformed, has unknown keys, or has invalid values."""


class DataError(PlflError):
    """A data set is missing, corrupt, unsafe, or cannot be partitioned as asked."""


class FederationError(PlflError):
    """Training cannot go on (too many failed clients, a non-finite global model); finished rounds are kept."""


class PlflWarning(UserWarning):
    """Something finished but not as configured (e.g. a capped loop); the message says what."""
