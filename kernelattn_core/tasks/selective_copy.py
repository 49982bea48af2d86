"""``selective-copy``: copy the marked tokens (Gu & Dao, 2023, *Mamba*, §3.1 and App. E.1).

Rules of the generator:

* token ``0`` is noise, token ``1`` the copy marker, tokens ``2 ... D+1`` the data tokens
  (``D`` = ``data_tokens``; ``vocab_size = D + 2``);
* the context (the first ``N - K`` positions) holds ``K`` data tokens, drawn uniformly with
  replacement, at ``K`` positions chosen uniformly without replacement and kept in order;
  every other context position is noise;
* the last ``K`` positions hold the marker; the target at the ``j``-th marker is the
  ``j``-th data token of the context. Nothing else is scored.

The data tokens' positions vary from example to example, so copying needs content-aware
(selective) mixing, not a fixed shift. Guessing gives ``1 / D``.
"""

from __future__ import annotations

import torch

from .base import IGNORE, Task, TaskBatch, TaskConfig, distinct, randint

NOISE, MARKER, FIRST_DATA = 0, 1, 2

CONFIGS = {
    "quick": TaskConfig(seq_len=128, vocab_size=18, params={"copies": 16}),
    # Mamba's setting: 16 data tokens to copy from a context of 4096
    "paper": TaskConfig(seq_len=4096 + 16, vocab_size=18, params={"copies": 16}),
}


def make(batch: int, config: TaskConfig, g: torch.Generator) -> TaskBatch:
    """``batch`` selective-copy examples (see the module docstring)."""
    n, copies = config.seq_len, int(config.params["copies"])
    data_tokens = config.vocab_size - FIRST_DATA
    context = n - copies
    data = randint(FIRST_DATA, FIRST_DATA + data_tokens, (batch, copies), g)  # [B, K]
    where = distinct(batch, copies, 0, context, g).sort(dim=1).values  # [B, K] in order
    inputs = torch.full((batch, n), NOISE, dtype=torch.long)
    inputs.scatter_(1, where, data)
    inputs[:, context:] = MARKER
    targets = torch.full((batch, n), IGNORE, dtype=torch.long)
    targets[:, context:] = data
    return TaskBatch(inputs=inputs, targets=targets)


TASK = Task(
    name="selective-copy",
    kind="lm",
    summary="copy the data tokens scattered among noise, in order, at the markers",
    source="Gu & Dao (2023), Mamba: Linear-time sequence modeling with selective state spaces",
    configs=CONFIGS,
    make=make,
    chance=lambda c: 1.0 / (c.vocab_size - FIRST_DATA),
)
