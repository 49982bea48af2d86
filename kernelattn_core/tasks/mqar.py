"""``mqar``: multi-query associative recall (Arora et al., 2023, *Zoology*, §3 and App. E).

Rules of the generator (Zoology's ``multiquery_ar``, with the query positions drawn
uniformly instead of from its power law):

* token ``0`` is filler; keys come from ``[1, V/2)`` and values from ``[V/2, V)``
  (``V`` = ``vocab_size``);
* the sequence opens with ``P`` key-value pairs ``k_1 v_1 k_2 v_2 ... k_P v_P``, the keys
  distinct within an example, the values drawn independently;
* the rest of the sequence (positions ``2P ... N-1``) is cut into slots of two tokens; ``P``
  slots, chosen uniformly without replacement, hold each key once in a random order,
  followed by its value (teacher forcing, as Zoology); the other slots are filler;
* the target at a queried key's position is its value (what a causal model must recall);
  nothing else is scored. The answer first appears in the input at the next position, which
  a causal model cannot see when it predicts.

Accuracy is over the ``P`` answers of each example; guessing a value gives ``2 / V``.
"""

from __future__ import annotations

import torch

from .base import IGNORE, Task, TaskBatch, TaskConfig, distinct, randint

CONFIGS = {
    # Zoology's smallest setting scaled to two CPU cores: vocabulary 256, 16 pairs in 128 tokens
    "quick": TaskConfig(seq_len=128, vocab_size=256, params={"pairs": 16}),
    # Zoology Fig. 2's middle column: 64 pairs in 256 tokens, vocabulary 8192
    "paper": TaskConfig(seq_len=256, vocab_size=8192, params={"pairs": 64}),
}


def make(batch: int, config: TaskConfig, g: torch.Generator) -> TaskBatch:
    """``batch`` MQAR examples (see the module docstring)."""
    n, vocab, pairs = config.seq_len, config.vocab_size, int(config.params["pairs"])
    half = vocab // 2
    slots = (n - 2 * pairs) // 2
    if slots < pairs:
        raise ValueError(f"mqar: {pairs} pairs need a sequence of at least {4 * pairs} tokens, got {n}")
    keys = distinct(batch, pairs, 1, half, g)  # [B, P]
    values = randint(half, vocab, (batch, pairs), g)  # [B, P]
    inputs = torch.zeros(batch, n, dtype=torch.long)
    targets = torch.full((batch, n), IGNORE, dtype=torch.long)
    inputs[:, 0 : 2 * pairs : 2], inputs[:, 1 : 2 * pairs : 2] = keys, values
    where = 2 * pairs + 2 * distinct(batch, pairs, 0, slots, g)  # [B, P] position of each query
    order = distinct(batch, pairs, 0, pairs, g)  # [B, P] which pair each query asks for
    asked_keys, asked_values = keys.gather(1, order), values.gather(1, order)
    inputs.scatter_(1, where, asked_keys)
    inputs.scatter_(1, where + 1, asked_values)
    targets.scatter_(1, where, asked_values)
    return TaskBatch(inputs=inputs, targets=targets)


TASK = Task(
    name="mqar",
    kind="lm",
    summary="multi-query associative recall: key-value pairs, then each key again; recall its value",
    source="Arora et al. (2023), Zoology: Measuring and improving recall in efficient language models",
    configs=CONFIGS,
    make=make,
    chance=lambda c: 1.0 / (c.vocab_size - c.vocab_size // 2),
)
