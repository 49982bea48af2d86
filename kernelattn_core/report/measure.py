"""Time and peak tensor memory of a forward call, measured alike on every device.

Peak memory counts the bytes of tensor storages that operators create while the
call runs (a ``__torch_dispatch__`` mode sees every allocation, also inside
composite operators) and releases them when the last tensor using them dies. Inputs
that exist before the call are not counted. On CUDA the allocator's own peak
counter is used instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _PeakTensorMemory(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, list[int]] = {}  # storage pointer -> [bytes, tensors alive]

    def _release(self, ptr: int) -> None:
        slot = self._live.get(ptr)
        if slot is None:
            return
        slot[1] -= 1
        if slot[1] == 0:
            self.current -= slot[0]
            del self._live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in inputs or ptr == 0:
                continue  # a view or in-place result: no new memory
            slot = self._live.get(ptr)
            if slot is None:
                slot = self._live[ptr] = [storage.nbytes(), 0]
                self.current += slot[0]
                self.peak = max(self.peak, self.current)
            slot[1] += 1
            weakref.finalize(t, self._release, ptr)
        return out


def peak_memory(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes of tensor memory allocated while ``fn()`` runs."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    mode = _PeakTensorMemory()
    with mode:
        result = fn()
    del result
    return mode.peak


def median_time(
    fn: Callable[[], Any], device: torch.device, repeats: int = 5, warmup: int = 1, min_run_time: float = 0.05
) -> float:
    """Median time per call of ``fn()`` in seconds, with :mod:`torch.utils.benchmark`.

    ``warmup`` untimed calls, one timed call :math:`c` (also a warmup), then
    ``Timer.blocked_autorange`` for at least :math:`\\max(\\text{repeats} \\cdot c,\\;
    \\text{min\\_run\\_time})` seconds: the timer picks the number of calls per block (so
    its own overhead stays negligible for fast calls), synchronises CUDA, runs with as
    many threads as torch uses here, and the result is the median over blocks of the
    time per call. So at least ``repeats`` calls are timed; fast calls get more.

    ``device`` is kept for the callers (the timer synchronises CUDA whenever it is
    available).
    """
    from torch.utils import benchmark

    for _ in range(warmup):
        fn()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    one = float(timer.timeit(1).median)
    return float(timer.blocked_autorange(min_run_time=max(repeats * one, min_run_time)).median)


def benchmark_time(fn: Callable[[], Any], device: torch.device, min_run_time: float = 0.2) -> dict[str, float]:
    """Time ``fn()`` with :mod:`torch.utils.benchmark` (``blocked_autorange``).

    The timer warms up, picks a block size so that one block lasts long enough to time
    reliably, synchronises CUDA itself and runs blocks for at least ``min_run_time``
    seconds, with as many threads as torch uses here (the timer's default is one).

    Returns
    -------
    dict
        ``median`` and interquartile range ``iqr`` of the per-call time (seconds) over the
        blocks, and ``calls``, the number of timed calls.
    """
    from torch.utils import benchmark

    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    m = timer.blocked_autorange(min_run_time=min_run_time)
    return {"median": float(m.median), "iqr": float(m.iqr), "calls": float(m.number_per_run * len(m.raw_times))}
