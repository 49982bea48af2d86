"""What every task of ``kernelattn tasks`` is: a generator of batches from a seed.

A task draws its examples in-process from a :class:`torch.Generator` (no downloads), so a
(task, scale, seed) triple fixes every example a model is trained and evaluated on. Two
kinds exist:

* ``"lm"``: autoregressive, the model is causal and predicts a token at some positions;
  ``targets [B, N]`` holds the token to predict there and :data:`IGNORE` elsewhere
  (accuracy is over the scored positions);
* ``"classify"``: the model is bidirectional and predicts one of ``num_classes`` labels per
  sequence (``labels [B]``), with ``padding [B, N]`` marking pad positions (``True``).

Evaluation examples come from their own generator stream (``seed`` offset by
:data:`EVAL_SEED_OFFSET`), disjoint from the training stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InputError

#: targets at unscored positions (the ``ignore_index`` of :func:`torch.nn.functional.cross_entropy`)
IGNORE = -100
#: evaluation batches are drawn from ``Generator().manual_seed(seed + EVAL_SEED_OFFSET)``
EVAL_SEED_OFFSET = 1_000_003
SCALES = ("quick", "paper")


@dataclass
class TaskBatch:
    """One batch of a task.

    Attributes
    ----------
    inputs : Tensor ``[B, N]`` of int64
        Token ids in ``[0, vocab_size)``.
    targets : Tensor ``[B, N]`` of int64, optional
        ``"lm"`` tasks: the token to predict at each position, :data:`IGNORE` where nothing
        is scored.
    labels : Tensor ``[B]`` of int64, optional
        ``"classify"`` tasks: the class of each sequence.
    padding : Tensor ``[B, N]`` of bool, optional
        ``True`` at padding (``"classify"`` tasks with sequences of different lengths).
    """

    inputs: torch.Tensor
    targets: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    padding: torch.Tensor | None = None


@dataclass(frozen=True)
class TaskConfig:
    """The sizes of a task at one scale (what the generator needs and what the model is built for)."""

    seq_len: int
    vocab_size: int
    num_classes: int | None = None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Task:
    """A registered task.

    Attributes
    ----------
    name : str
        ``kernelattn tasks --task NAME``.
    kind : {"lm", "classify"}
        Autoregressive (causal model, per-position targets) or sequence classification
        (bidirectional model, one label).
    summary : str
        One line for ``--help`` and the docs.
    source : str
        Where the task comes from (paper).
    configs : dict
        ``scale -> TaskConfig``.
    make : callable
        ``(batch, config, generator) -> TaskBatch``.
    chance : callable
        ``config -> float``: the accuracy of guessing (uniform over the possible answers).
    """

    name: str
    kind: str
    summary: str
    source: str
    configs: dict[str, TaskConfig]
    make: Callable[[int, TaskConfig, torch.Generator], TaskBatch]
    chance: Callable[[TaskConfig], float]

    @property
    def causal(self) -> bool:
        """Whether models of this task attend causally (``"lm"`` tasks)."""
        return self.kind == "lm"

    def config(self, scale: str = "quick") -> TaskConfig:
        """The sizes at ``scale`` (``"quick"`` or ``"paper"``)."""
        if scale not in self.configs:
            raise InputError(f"scale: expected one of {', '.join(self.configs)}, got {scale!r}")
        return self.configs[scale]

    def batch(
        self, batch_size: int, *, scale: str = "quick", seed: int = 0, generator: torch.Generator | None = None
    ) -> TaskBatch:
        """``batch_size`` examples; from ``generator`` when given, else from a generator seeded with ``seed``."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise InputError(f"batch_size: expected a positive int, got {batch_size!r}")
        g = generator if generator is not None else torch.Generator().manual_seed(seed)
        return self.make(batch_size, self.config(scale), g)


def randint(low: int, high: int, size: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """``torch.randint`` on ``g`` (int64)."""
    return torch.randint(low, high, size, generator=g, dtype=torch.long)


def distinct(batch: int, count: int, low: int, high: int, g: torch.Generator) -> torch.Tensor:
    """``[batch, count]`` draws without replacement from ``[low, high)``, one row per example."""
    if count > high - low:
        raise InputError(f"count: expected at most {high - low} distinct values in [{low}, {high}), got {count}")
    scores = torch.rand(batch, high - low, generator=g)
    return scores.argsort(dim=1)[:, :count] + low  # a uniform random subset in a uniform order
