"""``listops``: nested list operations (Nangia & Bowman, 2018; Long Range Arena, Tay et al., 2021).

Rules of the generator (LRA's ``listops.py``, at a smaller depth and length for the quick
scale):

* an expression is a value ``0 ... 9`` or ``[OP a_1 ... a_m ]`` with ``OP`` drawn uniformly
  from ``MIN``, ``MAX``, ``MED`` (median) and ``SM`` (sum modulo 10), ``m`` uniform in
  ``[2, max_args]`` and each argument again an expression;
* below ``max_depth`` an argument is an operation with probability ``1 - VALUE_P`` = 0.25
  and a value otherwise; at ``max_depth`` it is a value. The root is always an operation;
* expressions are drawn until their token count lies in ``[min_length, max_length]``
  (rejection, as LRA);
* ``MED`` of an even count is the integer part of the mean of the two middle values
  (LRA's ``int(np.median(x))``), so every result is a digit: 10 classes.

Tokens: ``0`` pad, ``1 ... 10`` the digits ``0 ... 9``, then ``[MIN``, ``[MAX``, ``[MED``,
``[SM`` and ``]``. The label is the value of the whole expression; sequences are padded on
the right to the longest of the batch (rounded up to a multiple of 16), with ``padding``
marking the pad. Guessing gives 0.1 (the majority class scores more: see the docs).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from .base import Task, TaskBatch, TaskConfig

PAD = 0
DIGIT0 = 1  # token of digit v is DIGIT0 + v
OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
VOCAB = ("<pad>", *(str(v) for v in range(10)), *OPERATORS, END)
TOKEN = {word: i for i, word in enumerate(VOCAB)}
VALUE_P = 0.75  # LRA: an argument below max_depth is a value when random() > 0.25

CONFIGS = {
    "quick": TaskConfig(
        seq_len=256,
        vocab_size=len(VOCAB),
        num_classes=10,
        params={"max_depth": 4, "max_args": 8, "min_length": 32, "max_length": 160},
    ),
    # LRA's setting: depth 10, 10 arguments, 500 to 2000 tokens
    "paper": TaskConfig(
        seq_len=2000,
        vocab_size=len(VOCAB),
        num_classes=10,
        params={"max_depth": 10, "max_args": 10, "min_length": 500, "max_length": 2000},
    ),
}

Tree = Any  # int | tuple[str, list[Tree]]


def apply(op: str, values: list[int]) -> int:
    """The value of ``[op values... ]`` (a digit)."""
    if op == "[MIN":
        return min(values)
    if op == "[MAX":
        return max(values)
    if op == "[SM":
        return sum(values) % 10
    if op == "[MED":
        s = sorted(values)
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) // 2
    raise ValueError(f"listops: unknown operator {op!r}")


def _tree(rng: random.Random, depth: int, max_depth: int, max_args: int, budget: int) -> tuple[Tree, int]:
    """An expression tree and its token count; stops growing (returns ``None``) past ``budget`` tokens."""
    if depth > 1 and (depth >= max_depth or rng.random() < VALUE_P):
        return rng.randrange(10), 1
    op = OPERATORS[rng.randrange(len(OPERATORS))]
    count = rng.randint(2, max_args)
    args, length = [], 2
    for _ in range(count):
        sub, sub_len = _tree(rng, depth + 1, max_depth, max_args, budget - length)
        if sub is None:
            return None, length + sub_len
        args.append(sub)
        length += sub_len
        if length > budget:
            return None, length
    return (op, args), length


def evaluate(tree: Tree) -> int:
    """The value of an expression tree."""
    if isinstance(tree, int):
        return tree
    op, args = tree
    return apply(op, [evaluate(a) for a in args])


def tokens(tree: Tree) -> list[str]:
    """The expression as tokens (``[MAX 3 [MIN 4 1 ] ]`` -> ``["[MAX", "3", "[MIN", ...]``)."""
    if isinstance(tree, int):
        return [str(tree)]
    op, args = tree
    out = [op]
    for a in args:
        out += tokens(a)
    return [*out, END]


def expression(rng: random.Random, config: TaskConfig) -> tuple[list[str], int]:
    """One expression within the length bounds of ``config`` and its value."""
    p = config.params
    while True:
        tree, length = _tree(rng, 1, int(p["max_depth"]), int(p["max_args"]), int(p["max_length"]))
        if tree is not None and int(p["min_length"]) <= length <= int(p["max_length"]):
            return tokens(tree), evaluate(tree)


def make(batch: int, config: TaskConfig, g: torch.Generator) -> TaskBatch:
    """``batch`` ListOps examples (see the module docstring)."""
    rng = random.Random(int(torch.randint(0, 2**62, (1,), generator=g)))
    exprs = [expression(rng, config) for _ in range(batch)]
    width = max(len(t) for t, _ in exprs)
    width = min(config.seq_len, -(-width // 16) * 16)
    inputs = torch.full((batch, width), PAD, dtype=torch.long)
    for i, (toks, _) in enumerate(exprs):
        inputs[i, : len(toks)] = torch.tensor([TOKEN[t] for t in toks])
    labels = torch.tensor([value for _, value in exprs], dtype=torch.long)
    return TaskBatch(inputs=inputs, labels=labels, padding=inputs == PAD)


def decode(row: torch.Tensor) -> str:
    """Token ids back to the expression text (padding dropped)."""
    return " ".join(VOCAB[int(t)] for t in row if int(t) != PAD)


TASK = Task(
    name="listops",
    kind="classify",
    summary="the value (0-9) of a nested MIN/MAX/MED/SUM-MOD expression",
    source="Nangia & Bowman (2018); Long Range Arena, Tay et al. (2021)",
    configs=CONFIGS,
    make=make,
    chance=lambda c: 0.1,
)
