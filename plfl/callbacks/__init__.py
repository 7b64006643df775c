"""Federation callbacks: logging, result files, progress (the loop stays free of them)."""

from plfl.callbacks.base import FederationCallback, RoundResult, RunInfo
from plfl.callbacks.files import RunFiles
from plfl.callbacks.progress import RoundProgress
from plfl.callbacks.wandb import WandbRun

__all__ = ["FederationCallback", "RoundProgress", "RoundResult", "RunFiles", "RunInfo", "WandbRun"]
