"""Split each layer's budget between an exact window, heavy keys and features, by measurement.

A hybrid estimator (``sliding-window``: exact keys :math:`2w + 1 + g + s`, features
:math:`D`) spends a per-query budget :math:`2w + 1 + g + s + D`. Local layers want a wide
window; diffuse ones (all-MiniLM-L6-v2's last layer keeps only 12 % of its mass inside
a window of 24) want the keys that draw the most attention computed exactly (heavy keys,
:mod:`kernelattn_hybrid.heavy`; that layer's output error halves with 64 of them) or
features. :func:`allocate_budget` tries every split of the same budget on every layer:
it fits each candidate briefly on the fitting data (the per-layer loss of
:func:`~kernelattn_core.convert.distill_attention`), measures its attention-output error
on a validation slice of the fitting text (never the evaluation text) and keeps the best,
already fitted, as the layer's estimator. The budget of every layer stays within the
total.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from ..validation import check_positive_int
from .distill import _Bar, _evaluate, _fit_layer, capture_layers


def splits(budget: int, windows: Sequence[int], global_tokens: int = 1) -> list[tuple[int, int]]:
    """``(window, num_features)`` pairs of total ``2w + 1 + g + D <= budget`` with an
    even ``D >= 2`` (``hedgehog`` features come in pairs); :func:`split_candidates`
    without heavy keys."""
    return [(w, d) for w, _, d in split_candidates(budget, windows, global_tokens)]


def split_candidates(
    budget: int, windows: Sequence[int], global_tokens: int = 1, heavy: Sequence[int] = (0,)
) -> list[tuple[int, int, int]]:
    """``(window, heavy_keys, num_features)`` triples of total ``2w + 1 + g + s + D <=
    budget`` with an even ``D >= 2``, for every window ``w`` and heavy-key count ``s``."""
    out = []
    for s in heavy:
        for w in windows:
            features = budget - (2 * w + 1) - global_tokens - s
            features -= features % 2
            if features >= 2:
                out.append((int(w), int(s), int(features)))
    return out


def allocate_budget(
    student: nn.Module,
    teacher: nn.Module,
    batches: Iterable[Any],
    validation: Iterable[Any],
    *,
    estimator: str = "sliding-window",
    options: dict[str, Any] | None = None,
    budget: int = 128,
    windows: Sequence[int] = (8, 16, 24, 32, 40, 48, 56),
    heavy: Sequence[int] | None = None,
    steps: int = 150,
    lr: float = 2e-2,
    rows: int = 96,
    loss: str = "ce",
    seed: int = 0,
    progress: bool | None = None,
) -> list[dict[str, Any]]:
    """Choose, for every converted layer, the window/heavy-key/feature split of ``budget``
    with the lowest validation error after a brief fit, and install it (fitted) in
    ``student``.

    Parameters
    ----------
    student, teacher : nn.Module
        The converted model (changed in place) and the original.
    batches, validation : iterable
        Fitting inputs and validation inputs (another part of the fitting corpus).
    estimator : str
        A hybrid estimator taking ``window``, ``num_features`` and ``global_tokens``.
    options : dict, optional
        The other estimator options (``activation``, ``global_tokens``, ...).
    budget : int
        Per-query budget :math:`2w + 1 + g + s + D` of every layer.
    windows : sequence of int
        Candidate half-widths :math:`w`.
    heavy : sequence of int, optional
        Candidate numbers of heavy keys :math:`s` (``sliding-window``'s ``heavy_keys``;
        non-causal models only). ``None``: the ``heavy_keys`` of ``options`` if given,
        else none.
    steps, lr, rows, loss, seed
        The brief fit of each candidate (see :func:`~kernelattn_core.convert.distill_attention`).
    progress : bool, optional

    Returns
    -------
    list of dict
        Per layer: ``layer``, ``name``, ``window``, ``heavy_keys``, ``num_features``,
        ``budget`` and ``candidates`` (``{"window", "heavy_keys", "num_features",
        "validation_error", "seconds"}``).
    """
    from ..module import build_estimator
    from .attention import converted_modules

    check_positive_int("budget", budget)
    check_positive_int("steps", steps, minimum=0)
    options = dict(options or {})
    fixed = options.pop("heavy_keys", None)
    if heavy is None:
        heavy = (0,) if fixed is None else (int(fixed),)
    elif fixed is not None:
        raise InputError(
            f"heavy: candidates {list(heavy)} given and options['heavy_keys']={fixed}: give the heavy keys one way"
        )
    g = int(options.get("global_tokens", 0))
    for s in heavy:
        check_positive_int("heavy", s, minimum=0)
    candidates = split_candidates(budget, windows, g, heavy)
    if not candidates:
        raise InputError(
            f"windows: no window of {list(windows)} (with heavy keys {list(heavy)}) leaves features within "
            f"budget={budget}"
        )
    fit_layers = capture_layers(student, teacher, batches)
    val_layers = capture_layers(student, teacher, validation)
    modules = dict(converted_modules(student))
    gen = torch.Generator().manual_seed(seed)
    bar = _Bar(steps * len(candidates) * len(fit_layers), "allocating", progress)
    out = []
    try:
        for index, (name, layer) in enumerate(fit_layers.items()):
            module = modules[name]
            ref = next(module.parameters())
            results = []
            best: tuple[float, nn.Module, int, int, int] | None = None
            for window, s, features in candidates:
                t0 = time.perf_counter()
                heavy_option = {"heavy_keys": s} if s else {}
                est = build_estimator(
                    estimator,
                    module.head_dim,
                    module.num_heads,
                    {**options, "window": window, "num_features": features, **heavy_option},
                ).to(device=ref.device, dtype=ref.dtype)
                est.eval()
                _fit_layer(
                    est,
                    layer,
                    steps=steps,
                    lr=lr,
                    loss=loss,
                    rows=rows,
                    gen=gen,
                    bar=bar,
                    label=f"layer {index} w{window}" + (f" s{s}" if s else ""),
                )
                error = _evaluate(est, val_layers[name], loss)[1]
                results.append(
                    {
                        "window": window,
                        "heavy_keys": s,
                        "num_features": features,
                        "validation_error": error,
                        "seconds": time.perf_counter() - t0,
                    }
                )
                if best is None or error < best[0]:
                    best = (error, est, window, s, features)
            assert best is not None
            module.estimator = best[1].train(module.training)
            out.append(
                {
                    "layer": index,
                    "name": name,
                    "window": best[2],
                    "heavy_keys": best[3],
                    "num_features": best[4],
                    "budget": 2 * best[2] + 1 + g + best[3] + best[4],
                    "candidates": results,
                }
            )
    finally:
        bar.close()
    return out
