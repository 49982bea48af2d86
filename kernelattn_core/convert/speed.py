"""Time a converted model against the original, and its attention alone at long lengths.

``python -m kernelattn_core.convert.speed`` (on a quiet machine) prints

* the forward time of all-MiniLM-L6-v2 and of its conversion at ``N = 512``, batch 8,
  with 1 and 2 threads: the original with its default attention (``sdpa``) and with
  ``eager`` attention (what hooks and fitting use), the converted model with the
  estimator of the documented recipe;
* the attention modules alone (one layer's ``q, k, v`` of 12 heads of width 32, batch 1)
  at 2K-16K tokens: the estimator, ``torch``'s fused SDPA and the eager softmax
  (``softmax(q k^T) v``; skipped where its ``[N, N]`` weights would pass 4 GiB).

Every figure is the fastest of ``repeats`` runs after one warm-up. Timings on a shared
machine are not comparable between runs; re-measure alone.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

#: the estimator of the documented MiniLM recipe (budget 2 x 24 + 1 + 1 + 78 = 128)
RECIPE: dict[str, Any] = {"window": 24, "num_features": 78, "global_tokens": 1, "activation": "exp"}
#: the recipe with heavy keys (budget 2 x 24 + 1 + 1 + 64 + 14 = 128; docs: "heavy keys")
HEAVY_RECIPE: dict[str, Any] = {**RECIPE, "num_features": 14, "heavy_keys": 64}
#: ``--recipe`` names
RECIPES: dict[str, dict[str, Any]] = {"window": RECIPE, "heavy": HEAVY_RECIPE}


def best_time(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Fastest of ``repeats`` calls of ``fn`` (seconds), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.no_grad()
def time_models(
    *,
    threads: tuple[int, ...] = (1, 2),
    batch: int = 8,
    length: int = 512,
    repeats: int = 3,
    recipe: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Forward time of the original MiniLM (``sdpa`` and ``eager``) and of its conversion
    with ``recipe`` (default :data:`RECIPE`), on ``batch`` packed passages of ``length``
    tokens."""
    from ..workloads import minilm
    from .attention import convert_attention

    eager, tok = minilm.load_model(attn_implementation="eager")
    sdpa, _ = minilm.load_model(attn_implementation="sdpa")
    student = convert_attention(eager, "sliding-window", **(recipe or RECIPE)).eval()
    text = minilm.held_out_text()
    inputs = minilm.random_passages(tok, text, length=length, count=batch, seed=0)
    rows = []
    before = torch.get_num_threads()
    try:
        for n in threads:
            torch.set_num_threads(n)
            row: dict[str, Any] = {"threads": n, "batch": batch, "length": length}
            for name, model in (("original_sdpa", sdpa), ("original_eager", eager), ("converted", student)):
                row[f"{name}_s"] = best_time(lambda model=model: model(**inputs), repeats)
            row["converted_vs_sdpa"] = row["original_sdpa_s"] / row["converted_s"]
            row["converted_vs_eager"] = row["original_eager_s"] / row["converted_s"]
            rows.append(row)
    finally:
        torch.set_num_threads(before)
    return rows


@torch.no_grad()
def time_attention(
    *,
    lengths: tuple[int, ...] = (512, 2048, 4096, 8192, 16384),
    heads: int = 12,
    head_dim: int = 32,
    repeats: int = 3,
    recipe: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One attention layer at each length: the ``recipe`` estimator (default
    :data:`RECIPE`), fused SDPA and the eager softmax (batch 1, ``heads`` heads of width
    ``head_dim``)."""
    from .. import create

    est = create("sliding-window", num_heads=heads, head_dim=head_dim, **(recipe or RECIPE)).eval()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in lengths:
        q, k, v = (torch.randn(1, heads, n, head_dim, generator=gen) * 0.4 for _ in range(3))
        row: dict[str, Any] = {"length": n, "threads": torch.get_num_threads()}
        row["estimator_s"] = best_time(lambda q=q, k=k, v=v: est(q, k, v), repeats)
        row["sdpa_s"] = best_time(
            lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q, k, v), repeats
        )
        if heads * n * n * 4 <= 4 * 2**30:
            row["eager_s"] = best_time(
                lambda q=q, k=k, v=v: torch.softmax(q @ k.transpose(-1, -2) * head_dim**-0.5, -1) @ v, repeats
            )
        else:
            row["eager_s"] = float("nan")
        row["speedup_vs_sdpa"] = row["sdpa_s"] / row["estimator_s"]
        row["speedup_vs_eager"] = row["eager_s"] / row["estimator_s"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print both tables (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m kernelattn_core.convert.speed", description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", default="1,2", help="thread counts of the model timing")
    p.add_argument("--lengths", default="512,2048,4096,8192,16384", help="lengths of the attention timing")
    p.add_argument("--skip-models", action="store_true")
    p.add_argument(
        "--recipe", choices=sorted(RECIPES), default="window", help="the converted estimator (heavy: with heavy keys)"
    )
    args = p.parse_args(argv)
    recipe = RECIPES[args.recipe]
    from ..report.output import table

    if not args.skip_models:
        rows = time_models(threads=tuple(int(t) for t in args.threads.split(",")), repeats=args.repeats, recipe=recipe)
        print(table(rows, list(rows[0])))
        print()
    rows = time_attention(lengths=tuple(int(n) for n in args.lengths.split(",")), repeats=args.repeats, recipe=recipe)
    print(table(rows, list(rows[0])))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
