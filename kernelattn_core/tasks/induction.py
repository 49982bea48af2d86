"""``induction``: complete a repeated pattern (Olsson et al., 2022, *In-context learning and
induction heads*; the repeated-random-tokens test).

Rules of the generator:

* the first ``N - S`` tokens are distinct, drawn uniformly without replacement from
  ``[1, V)`` (``V`` = ``vocab_size``, ``S`` = ``repeat``), so every token of the prefix
  occurs once;
* a window of ``S`` consecutive prefix tokens starting at ``a``, uniform in
  ``[0, N - 2S - 1]``, is repeated as the last ``S`` tokens;
* at each of the last ``S`` positions the target is the next token of the pattern: the token
  that followed the current token in the window (for the last position, the prefix token
  after the window). Nothing else is scored.

The window's offset varies, so a fixed positional shift cannot solve it: the model must
find the earlier occurrence of the current token and read its successor (an induction
head). Guessing gives ``1 / (V - 1)``.
"""

from __future__ import annotations

import torch

from .base import IGNORE, Task, TaskBatch, TaskConfig, distinct, randint

CONFIGS = {
    "quick": TaskConfig(seq_len=128, vocab_size=256, params={"repeat": 32}),
    "paper": TaskConfig(seq_len=1024, vocab_size=4096, params={"repeat": 256}),
}


def make(batch: int, config: TaskConfig, g: torch.Generator) -> TaskBatch:
    """``batch`` induction examples (see the module docstring)."""
    n, vocab, s = config.seq_len, config.vocab_size, int(config.params["repeat"])
    prefix = n - s
    if prefix < s + 1:
        raise ValueError(f"induction: a repeat of {s} needs a sequence of at least {2 * s + 1} tokens, got {n}")
    head = distinct(batch, prefix, 1, vocab, g)  # [B, N - S]
    start = randint(0, prefix - s, (batch, 1), g)  # [B, 1] window start a <= N - 2S - 1
    offsets = torch.arange(s + 1)[None, :]  # the window and the token after it
    window = head.gather(1, start + offsets)  # [B, S + 1]
    inputs = torch.cat([head, window[:, :s]], dim=1)
    targets = torch.full((batch, n), IGNORE, dtype=torch.long)
    targets[:, prefix:] = window[:, 1:]
    return TaskBatch(inputs=inputs, targets=targets)


TASK = Task(
    name="induction",
    kind="lm",
    summary="a window of distinct tokens repeats at the end; predict each next token of the repeat",
    source="Olsson et al. (2022), In-context learning and induction heads",
    configs=CONFIGS,
    make=make,
    chance=lambda c: 1.0 / (c.vocab_size - 1),
)
