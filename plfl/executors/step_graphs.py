"""Lock-step steps recorded once per key and replayed: as CUDA graphs on a CUDA device, eagerly elsewhere.

A step of the vectorized executor launches a few hundred small kernels, and on a GPU the Python, ``torch.func``
and launch costs of issuing them outweigh the kernels themselves. A CUDA graph records the kernels of one call
and replays them with one launch (PyTorch, "CUDA Graphs"). A replay runs on the very tensors the capture saw,
so a step must read its inputs from, and write its results into, tensors that outlive it
(:class:`~plfl.executors.lockstep.CohortState`); everything else it computes, including Python values such as
how many clients are active, is fixed at capture and so belongs in the key. On every device the step first
recorded for a key is the one replayed, so the CPU tests check that discipline too.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Callable, Hashable, Optional

import torch

from plfl.errors import PlflWarning

LockStep = Callable[[], None]  # one lock-step step: reads and writes tensors that outlive it


class StepGraphs:
    """Runs ``step`` for ``key``: the step recorded at the key's first call, captured as a CUDA graph when
    ``capture`` (warmed up ``warmup`` times first, on a side stream as CUDA graphs require, checked against
    an eager step, and the tensors it mutates restored after), else called eagerly. A capture that fails or
    replays wrongly turns capture off for good, with a ``PlflWarning``."""

    def __init__(self, capture: bool, warmup: Optional[int] = None):
        self.capture = capture
        self.warmup = (3 if capture else 0) if warmup is None else warmup  # PyTorch's examples warm up 3 times
        self.replays: dict[Hashable, LockStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # graphs share memory: steps keep nothing

    def __call__(self, key: Hashable, step: LockStep, mutated: Callable[[], list[torch.Tensor]]) -> None:
        """Run ``key``'s recorded step (``step`` the first time); ``mutated()``: the tensors a step writes, which
        a warm-up must leave as it found them."""
        replay = self.replays.get(key)
        if replay is None:
            replay = self.replays[key] = self._record(step, mutated())
        replay()

    def clear(self) -> None:
        """Forget every recorded step (the tensors they read or write were replaced), and their memory pool.

        Later captures go to a new pool: PyTorch's allocator keeps a pool whose graphs are all destroyed until
        its memory is released, and a capture into it fails an internal assert (``use_count > 0``,
        CUDACachingAllocator's ``create_or_incref_pool``). Emptying the cache releases the old pool's memory.
        """
        self.replays.clear()
        if self.capture:
            torch.cuda.empty_cache()
            self.pool = torch.cuda.graph_pool_handle()

    def _record(self, step: LockStep, mutated: list[torch.Tensor]) -> LockStep:
        if not self.capture and not self.warmup:
            return step
        saved = [t.clone() for t in mutated]
        try:
            replay = self._warm_up_and_capture(step)
            if replay is not step and not self._replays_as_eager(replay, step, mutated, saved):
                self._give_up("a captured step's replay differs from the step run eagerly")
                return step
            return replay
        finally:
            _copy(mutated, saved)

    def _warm_up_and_capture(self, step: LockStep) -> LockStep:
        stream = torch.cuda.Stream() if self.capture else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # the warm-up overwrites what was saved
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for _ in range(self.warmup):
                step()
        if stream is None:
            return step
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                step()
        except RuntimeError as error:  # an op CUDA cannot capture
            self._give_up(f"capturing a lock-step step failed ({error})")
            return step
        return graph.replay

    @staticmethod
    def _replays_as_eager(
        replay: LockStep, step: LockStep, mutated: list[torch.Tensor], saved: list[torch.Tensor]
    ) -> bool:
        """Whether one replay from ``saved`` writes what one eager step from it does, by each tensor's sum and sum
        of magnitudes (no second copy of a cohort's state), to float rounding (some CUDA kernels sum in varying
        order): a capture that went wrong silently must not train anyone."""
        _copy(mutated, saved)
        replay()
        replayed = [_fingerprint(t) for t in mutated]
        _copy(mutated, saved)
        step()
        return all(torch.allclose(a, _fingerprint(t), rtol=1e-5, atol=1e-6) for a, t in zip(replayed, mutated))

    def _give_up(self, reason: str) -> None:
        """From now on, steps run eagerly (exactly as without graphs), after one notice."""
        warnings.warn(
            PlflWarning(
                f"vectorized.cuda_graphs: {reason}; the vectorized executor runs its steps without CUDA graphs."
            ),
            stacklevel=4,
        )
        self.capture, self.warmup = False, 0


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """(2,) float64: the tensor's sum and the sum of its magnitudes."""
    return torch.stack([tensor.sum(dtype=torch.float64), tensor.abs().sum(dtype=torch.float64)])


def _copy(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    for target, value in zip(targets, values):
        target.copy_(value)
