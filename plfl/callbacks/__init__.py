"""Federation callbacks: logging, result files, progress (the loop stays free of them)."""

from plfl.callbacks.base import FederationCallback, RoundResult, RunInfo
from plfl.callbacks.checkpoint import Checkpoints
from plfl.callbacks.files import RunFiles
from plfl.callbacks.progress import RoundProgress, RunStart
from plfl.callbacks.wandb import WandbRun

__all__ = [
    "Checkpoints",
    "FederationCallback",
    "RoundProgress",
    "RoundResult",
    "RunFiles",
    "RunInfo",
    "RunStart",
    "WandbRun",
]
