"""Engine claims (EN001-EN003): what an estimator computes, against the quadratic
reference, under causality and under padding — outputs and gradients, in float64.

Every check here is deterministic (fixed seeds, float64, eval mode) and compares the
runtime estimator with itself or with a plain quadratic form, so a pass is exact up to
rounding (``rtol``) and a failure names the tensor and the size of the difference.

* **EN001** runs the estimator's public ``forward`` (validation, scaling, its own
  ``_attend`` whatever it is, the engine's grouped and chunked passes) and the reference
  on the same inputs, then compares outputs and the gradients of a fixed random
  weighting of the output with respect to ``q``, ``k``, ``v`` and every trainable
  parameter. The engine is run with chunks of ``chunk_size`` positions and groups of one
  chunk (:data:`kernelattn_core.engine.grouped.GROUP_BYTES` lowered for the check), so a
  sequence of ``seq_len`` positions crosses chunk and group boundaries.
* **EN002** perturbs positions after a cut (other values, large values, NaN) and asks
  that earlier outputs and their gradients do not move.
* **EN003** perturbs padded keys the same way and asks the same of every output.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator
from typing import Any

import torch

from ..claims import EngineReference, PaddingInvariance, PrefixInvariance
from .result import CheckResult, verdict

SEED = 20_261_127
#: keyword arguments of FeatureMapAttention (the rest of a feature-map name's options go to the map)
_FMA_KEYWORDS = ("normalizer", "num_features", "head_dim", "redraw_every", "seed", "chunk_size", "backend", "scale")


# --------------------------------------------------------------------------- building the estimator
def _registered(entry: Any) -> bool:
    from ..registry import get_registry

    try:
        return get_registry().get(entry.name).cls is entry.cls
    except Exception:
        return False


def build_estimator(entry: Any, options: Any, num_features: int) -> Any:
    """The estimator a claim on ``entry`` checks: ``create(name, **options)`` for a
    registered class (a feature map wrapped in feature-map attention), else the class
    itself (an unregistered mutant in the tests), in float64 and eval mode."""
    from ..api import create
    from ..builtins.estimators import FeatureMapAttention

    opts = dict(options)
    if getattr(entry.cls, "has_budget", False) and "num_features" not in opts:
        opts["num_features"] = num_features
    torch.manual_seed(SEED)  # estimators that take a seed from the global generator
    if _registered(entry):
        est = create(entry.name, **opts)
    elif entry.kind == "feature_map":
        est_opts = {k: v for k, v in opts.items() if k in _FMA_KEYWORDS and k != "num_features"}
        map_opts = {k: v for k, v in opts.items() if k not in _FMA_KEYWORDS or k == "num_features"}
        est = FeatureMapAttention(entry.cls(**map_opts), **est_opts)
    else:
        est = entry.cls(**opts)
    return est.double().eval()


def _perturb(module: torch.nn.Module, std: float, seed: int) -> None:
    """Add seeded Gaussian noise of ``std`` to every floating parameter (trained-like values)."""
    if std <= 0:
        return
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * std)


@contextlib.contextmanager
def small_groups(chunk: int | None) -> Iterator[None]:
    """Run the torch engine with groups of one chunk (group and chunk boundaries inside
    short sequences): :data:`~kernelattn_core.engine.grouped.GROUP_BYTES` is set to 1 and
    :data:`~kernelattn_core.engine.grouped.SHORT_TRAINING` to 0 for the duration (the group
    length is then the chunk length, in training too), and feature-map attention
    uses chunks of ``chunk`` positions. ``None`` leaves the engine as configured."""
    if chunk is None:
        yield
        return
    from ..engine import grouped

    saved = grouped.GROUP_BYTES, grouped.SHORT_TRAINING
    grouped.GROUP_BYTES, grouped.SHORT_TRAINING = 1, 0  # short training calls too: several groups
    try:
        yield
    finally:
        grouped.GROUP_BYTES, grouped.SHORT_TRAINING = saved


def _set_chunk(est: Any, chunk: int | None) -> None:
    """Use chunks of ``chunk`` positions where the estimator has a ``chunk_size``."""
    if chunk is not None and hasattr(est, "chunk_size"):
        est.chunk_size = chunk


def _prepared(entry: Any, claim: Any, options: Any) -> Any:
    est = build_estimator(entry, options, claim.num_features)
    _warm(est, claim)
    est.double()  # parameters a lazily built map created on the first call
    _perturb(est, claim.perturb, SEED + 7)
    if claim.setup is not None:
        claim.setup(est, torch.Generator().manual_seed(SEED + 11))
    return est


def _warm(est: Any, claim: Any) -> None:
    """Build lazily built parts (a map's draws, per-head parameters) by one call, so that
    ``perturb`` and ``setup`` see every parameter."""
    n = 4
    q = torch.zeros(1, claim.heads, n, claim.dim, dtype=torch.float64)
    causal = not getattr(est, "supports_noncausal", True)
    with torch.no_grad():
        est(q, q, torch.zeros(1, claim.heads, n, 5, dtype=torch.float64), causal=causal)  # dv as in _inputs


def _inputs(claim: Any, n: int, seed: int, dv: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, claim.heads, n, claim.dim)
    q = torch.randn(shape, generator=g, dtype=torch.float64) * 0.7
    k = torch.randn(shape, generator=g, dtype=torch.float64) * 0.7
    v = torch.randn(2, claim.heads, n, dv, generator=g, dtype=torch.float64)
    return q, k, v


def _mask(n: int, tail: int = 3) -> torch.Tensor:
    """``[2, n]`` padding: row 0 pads two inner keys and the last ``tail``; row 1 only the tail."""
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[:, n - tail :] = True
    mask[0, [2, n // 2]] = True
    return mask


def _params(est: Any) -> list[tuple[str, torch.Tensor]]:
    return [(name, p) for name, p in est.named_parameters() if p.requires_grad]


def _grads(
    out: torch.Tensor, weight: torch.Tensor, tensors: list[tuple[str, torch.Tensor]]
) -> dict[str, torch.Tensor | None]:
    """Gradients of ``sum(out * weight)`` with respect to ``tensors`` (``None``: unreached)."""
    loss = (out * weight).sum()
    got = torch.autograd.grad(loss, [t for _, t in tensors], allow_unused=True)
    return {name: g for (name, _), g in zip(tensors, got)}


def _rel(a: torch.Tensor | None, b: torch.Tensor | None, floor: float = 0.0) -> float:
    """``max|a - b| / max(max|b|, floor)`` (0 when both are None or zero; inf on a shape or
    NaN mismatch). ``floor`` is the scale below which a gradient counts as zero (a
    parameter whose gradient vanishes identically, such as a log-scale that cancels in
    the ratio, has rounding noise on both sides)."""
    if a is None or b is None:
        zero_a = a is None or bool((a == 0).all())
        zero_b = b is None or bool((b == 0).all())
        return 0.0 if zero_a and zero_b else math.inf
    if a.shape != b.shape:
        return math.inf
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)) or not torch.equal(a.isnan(), b.isnan()):
        return math.inf
    diff = (a - b)[torch.isfinite(b)].abs()
    if diff.numel() == 0:
        return 0.0
    scale = float(b[torch.isfinite(b)].abs().max()) if b.numel() else 0.0
    return float(diff.max()) / max(scale, floor, 1e-300)


def _fmt(x: float) -> float | str:
    return float(f"{x:.3g}") if math.isfinite(x) else "inf"


# --------------------------------------------------------------------------- the implied reference
def feature_map_reference(
    est: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, key_padding_mask: torch.Tensor | None
) -> torch.Tensor:
    """The quadratic reference of feature-map attention on scaled ``q``, ``k``: the
    estimator's normaliser ``pre``, its map's ``prepare`` and features, the full
    ``[N, M]`` matrix of :func:`~kernelattn_core.engine.naive.feature_attention_naive`,
    then ``normalize`` and ``post``."""
    from ..engine.naive import feature_attention_naive

    q, k = est._pre(q, k, key_padding_mask, causal)
    fm = est.feature_map
    fm.prepare(q, k, key_padding_mask=key_padding_mask, causal=causal)
    phi_q, phi_k = fm.raw_features(q, query=True), fm.raw_features(k, query=False)
    num, den = feature_attention_naive(
        phi_q, phi_k, v, log_space=fm.log_space, causal=causal, key_padding_mask=key_padding_mask
    )
    return est.normalizer.post(est.normalizer.normalize(num, den)).to(v.dtype)


def reference_of(entry: Any, claim: EngineReference) -> Any:
    """The declared reference, or the implied one for feature-map attention (None: none)."""
    from ..builtins.estimators import FeatureMapAttention

    if claim.reference is not None:
        return claim.reference
    if entry.kind == "feature_map" or issubclass(entry.cls, FeatureMapAttention):
        return feature_map_reference
    return None


def _modes(entry: Any, wanted: tuple[bool, ...]) -> list[bool]:
    cls = entry.cls
    if entry.kind == "feature_map":
        return list(wanted)
    out = []
    for causal in wanted:
        if causal and not getattr(cls, "supports_causal", True):
            continue
        if not causal and not getattr(cls, "supports_noncausal", True):
            continue
        out.append(causal)
    return out


# --------------------------------------------------------------------------- EN001
def check_engine_reference(entry: Any, claim: EngineReference, level: str, **ids: str) -> CheckResult:
    """EN001: outputs and gradients of ``forward`` against the quadratic reference."""
    reference = reference_of(entry, claim)
    if reference is None:
        raise TypeError(
            f"{entry.name}: EN001 needs a reference (reference=...) for an estimator that is not feature-map attention"
        )
    modes = _modes(entry, claim.modes)
    if not modes:
        raise TypeError(f"{entry.name}: none of the modes {list(claim.modes)} is supported by the class")
    # (seq_len, chunk forced small or the estimator's own): full level adds a longer sequence
    runs: list[tuple[int, int | None]] = [(claim.seq_len, claim.chunk_size)]
    if level == "full":
        runs.append((3 * claim.seq_len + 2, None))
    worst: dict[str, float] = {}
    checked = 0
    for n, chunk in runs:
        for causal in modes:
            for masked in (False, True):
                est = _prepared(entry, claim, claim.options)
                _set_chunk(est, chunk)
                q, k, v = _inputs(claim, n, SEED + n + 2 * causal + masked)
                mask = _mask(n) if masked else None
                weight = torch.randn(
                    2, claim.heads, n, v.shape[-1], generator=torch.Generator().manual_seed(SEED + 3), dtype=v.dtype
                )
                leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
                tensors = [("q", leaves[0]), ("k", leaves[1]), ("v", leaves[2]), *_params(est)]
                with small_groups(chunk):
                    out = est(*leaves, causal=causal, key_padding_mask=mask)
                got = _grads(out, weight, tensors)
                root = est._input_root(claim.dim)
                ref = reference(est, leaves[0] * root, leaves[1] * root, leaves[2], causal, mask)
                want = _grads(ref, weight, tensors)
                tag = f"{'causal' if causal else 'noncausal'}{'_masked' if masked else ''}" + (
                    f"_N{n}" if n != claim.seq_len else ""
                )
                pairs = [("out", out.detach(), ref.detach())] + [(name, got[name], want[name]) for name, _ in tensors]
                # a gradient 1e-3 of the largest input gradient is compared at that scale (a
                # gradient that vanishes identically has rounding noise on both sides)
                floor = 1e-3 * max(float(want[x].abs().max()) for x in "qkv" if want[x] is not None)
                for name, a, b in pairs:
                    key = f"{tag}:{name}"
                    worst[key] = _rel(a, b, 0.0 if name == "out" else floor)
                    checked += 1
    bad = {key: value for key, value in worst.items() if not value <= claim.rtol}
    top = max(worst, key=lambda key: worst[key] if math.isfinite(worst[key]) else math.inf)
    numbers: dict[str, Any] = {
        "tensors_compared": checked,
        "max_rel_diff": _fmt(worst[top]),
        "worst": top,
        "rtol": claim.rtol,
        "modes": ["causal" if m else "non-causal" for m in modes],
        "seq_lens": [n for n, _ in runs],
    }
    if bad:
        numbers["failing"] = {key: _fmt(value) for key, value in list(bad.items())[:6]}
    return CheckResult(
        EngineReference.rule,
        claim=(
            f"outputs and gradients (q, k, v, parameters) == quadratic reference from the same features, "
            f"{'/'.join(numbers['modes'])}, with and without padding, chunk {claim.chunk_size}"
        ),
        numbers=numbers,
        verdict=verdict(not bad),
        **ids,
    )


# --------------------------------------------------------------------------- EN002, EN003 helpers
def _call(est: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: Any) -> torch.Tensor:
    torch.manual_seed(SEED + 5)  # estimators that draw per call (eval mode) draw the same
    return est(q, k, v, causal=causal, key_padding_mask=mask)


def _shape_free(entry: Any, est: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    """Whether calls of other lengths may be compared: the estimator is deterministic in eval
    mode (two calls under different global seeds agree) and its draws, if any, do not
    depend on the sequence length (no draws, or feature-map attention, whose features are
    drawn per map). A sampling estimator draws per position: its draws on a prefix differ."""
    from ..builtins.estimators import FeatureMapAttention

    if getattr(entry.cls, "random", False) and not isinstance(est, FeatureMapAttention):
        return False
    return _deterministic(est, q, k, v, causal)


def _deterministic(est: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    """Whether two calls under different global seeds agree (eval mode)."""
    with torch.no_grad():
        torch.manual_seed(1)
        a = est(q, k, v, causal=causal)
        torch.manual_seed(2)
        b = est(q, k, v, causal=causal)
    return bool(torch.equal(a, b))


def _replacements(x: torch.Tensor, where: torch.Tensor, seed: int) -> list[tuple[str, torch.Tensor]]:
    """``x`` with the positions ``where`` (broadcast to ``x``) replaced by other values, by
    1e4 and by NaN."""
    g = torch.Generator().manual_seed(seed)
    other = torch.randn(x.shape, generator=g, dtype=x.dtype) * 2.0
    return [
        ("other", torch.where(where, other, x)),
        ("1e4", torch.where(where, torch.full_like(x, 1e4), x)),
        ("nan", torch.where(where, torch.full_like(x, math.nan), x)),
    ]


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.clone().requires_grad_(True) for t in tensors]


# --------------------------------------------------------------------------- EN002
def check_prefix_invariance(entry: Any, claim: PrefixInvariance, level: str, **ids: str) -> CheckResult:
    """EN002: rows before a cut are blind to later positions, in outputs and gradients."""
    if entry.kind != "feature_map" and not getattr(entry.cls, "supports_causal", True):
        raise TypeError(f"{entry.name}: EN002 is a causal claim, and the class does not support causal=True")
    n = claim.seq_len
    cuts = claim.cuts if level == "full" else claim.cuts[-1:]
    problems: list[str] = []
    checked, worst = 0, 0.0
    prefix_checked = False
    est = _prepared(entry, claim, claim.options)
    _set_chunk(est, claim.chunk_size)
    q, k, v = _inputs(claim, n, SEED + 21)
    weight = torch.randn(v.shape, generator=torch.Generator().manual_seed(SEED + 22), dtype=v.dtype)
    with small_groups(claim.chunk_size):
        deterministic = _shape_free(entry, est, q, k, v, True)
        for t in cuts:
            head = weight.clone()
            head[:, :, t:] = 0.0  # the loss reads rows before the cut only
            base = _leaves(q, k, v)
            out = _call(est, *base, True, None)
            ref_grads = _grads(out, head, list(zip("qkv", base)))
            future = torch.zeros(1, 1, n, 1, dtype=torch.bool)
            future[:, :, t:] = True
            for (label, q2), (_, k2), (_, v2) in zip(
                _replacements(q, future, SEED + t),
                _replacements(k, future, SEED + 100 + t),
                _replacements(v, future, SEED + 200 + t),
            ):
                leaves = _leaves(q2, k2, v2)
                out2 = _call(est, *leaves, True, None)
                grads = _grads(out2, head, list(zip("qkv", leaves)))
                rel = _rel(out2[:, :, :t].detach(), out[:, :, :t].detach())
                checked += 1
                worst = max(worst, rel)
                if not rel <= 1e-10:
                    problems.append(f"cut {t}, future {label}: earlier outputs moved (rel {_fmt(rel)})")
                # a gradient below 1e-3 of the largest earlier one is compared at that scale (one
                # that vanishes identically is rounding noise on one path and exact 0 on another)
                floor = 1e-3 * max(
                    (float(ref_grads[x][:, :, :t].abs().max()) for x in "qkv" if ref_grads[x] is not None), default=0.0
                )
                for name, leaf in zip("qkv", leaves):
                    g2, g = grads[name], ref_grads[name]
                    g2 = torch.zeros_like(leaf) if g2 is None else g2
                    g = torch.zeros_like(leaf) if g is None else g
                    # later positions get exactly zero gradient (for other finite values; a NaN or
                    # overflowing input's own gradient is its own business), earlier ones are unchanged
                    if label == "other" and not bool((g2[:, :, t:] == 0).all()):
                        problems.append(f"cut {t}, future {label}: the gradient reaching later {name} is not zero")
                    rel = _rel(g2[:, :, :t], g[:, :, :t], floor)
                    worst = max(worst, rel)
                    checked += 1
                    if not rel <= 1e-9:
                        problems.append(
                            f"cut {t}, future {label}: the gradient of earlier {name} moved (rel {_fmt(rel)})"
                        )
            if deterministic:
                with torch.no_grad():
                    part = _call(est, q[:, :, :t], k[:, :, :t], v[:, :, :t], True, None)
                rel = _rel(part, out[:, :, :t].detach())
                worst = max(worst, rel)
                checked += 1
                prefix_checked = True
                if not rel <= 1e-9:
                    problems.append(f"cut {t}: the output on the prefix alone differs (rel {_fmt(rel)})")
    numbers: dict[str, Any] = {
        "comparisons": checked,
        "max_rel_diff": _fmt(worst),
        "cuts": list(cuts),
        "prefix_call_compared": prefix_checked,
    }
    if problems:
        numbers["problems"] = problems[:6]
    return CheckResult(
        PrefixInvariance.rule,
        claim=(
            f"causal rows before t are blind to positions >= t (other values, 1e4, NaN), outputs and gradients, "
            f"t in {list(cuts)}" + ("; equal to the prefix call" if prefix_checked else "")
        ),
        numbers=numbers,
        verdict=verdict(not problems),
        **ids,
    )


# --------------------------------------------------------------------------- EN003
def check_padding_invariance(entry: Any, claim: PaddingInvariance, level: str, **ids: str) -> CheckResult:
    """EN003: padded keys leave every output and gradient; the padded tail is as if absent."""
    modes = _modes(entry, (False, True))
    if not modes:
        raise TypeError(f"{entry.name}: supports neither causal nor non-causal calls")
    if level != "full":
        modes = modes[:1]
    n = claim.seq_len
    problems: list[str] = []
    checked, worst = 0, 0.0
    removal_checked = False
    est = _prepared(entry, claim, claim.options)
    _set_chunk(est, claim.chunk_size)
    mask = _mask(n)
    padded = mask[:, None, :, None]  # [B, 1, M, 1]
    with small_groups(claim.chunk_size):
        for causal in modes:
            q, k, v = _inputs(claim, n, SEED + 31 + causal)
            deterministic = _shape_free(entry, est, q, k, v, causal)
            weight = torch.randn(v.shape, generator=torch.Generator().manual_seed(SEED + 32), dtype=v.dtype)
            base = _leaves(q, k, v)
            out = _call(est, *base, causal, mask)
            ref_grads = _grads(out, weight, list(zip("qkv", base)))
            if not bool(torch.isfinite(out).all()):
                problems.append(f"{'causal' if causal else 'non-causal'}: non-finite output with finite inputs")
            for (label, k2), (_, v2) in zip(_replacements(k, padded, SEED + 41), _replacements(v, padded, SEED + 42)):
                leaves = _leaves(q, k2, v2)
                out2 = _call(est, *leaves, causal, mask)
                grads = _grads(out2, weight, list(zip("qkv", leaves)))
                rel = _rel(out2.detach(), out.detach())
                worst = max(worst, rel)
                checked += 1
                tag = f"{'causal' if causal else 'non-causal'}, padded keys {label}"
                if not rel <= 1e-10:
                    problems.append(f"{tag}: outputs moved (rel {_fmt(rel)})")
                floor = 1e-3 * max((float(g.abs().max()) for g in ref_grads.values() if g is not None), default=0.0)
                for name in "qkv":
                    g2 = grads[name]
                    g = ref_grads[name]
                    g2 = (
                        torch.zeros_like(leaves[0] if name == "q" else leaves[1 if name == "k" else 2])
                        if g2 is None
                        else g2
                    )
                    g = torch.zeros_like(g2) if g is None else g
                    if (
                        name != "q"
                        and label == "other"
                        and not bool((g2.masked_select(padded.expand_as(g2)) == 0).all())
                    ):
                        problems.append(f"{tag}: the padded {name} get a non-zero gradient")
                    keep = ~padded.expand_as(g2) if name != "q" else torch.ones_like(g2, dtype=torch.bool)
                    rel = _rel(g2[keep], g[keep], floor)
                    worst = max(worst, rel)
                    checked += 1
                    if not rel <= 1e-9:
                        problems.append(f"{tag}: the gradient of {name} moved (rel {_fmt(rel)})")
            if claim.removal and deterministic:
                tail = int(mask[1].sum())  # row 1 pads the tail only
                with torch.no_grad():
                    if causal:
                        cut = n - tail
                        short = _call(est, q[1:, :, :cut], k[1:, :, :cut], v[1:, :, :cut], True, None)
                        rel = _rel(short, out[1:, :, :cut].detach())
                    else:
                        short = _call(est, q[1:], k[1:, :, : n - tail], v[1:, :, : n - tail], False, None)
                        rel = _rel(short, out[1:].detach())
                worst = max(worst, rel)
                checked += 1
                removal_checked = True
                if not rel <= 1e-9:
                    problems.append(
                        f"{'causal' if causal else 'non-causal'}: the call without the padded tail differs "
                        f"(rel {_fmt(rel)})"
                    )
    numbers: dict[str, Any] = {
        "comparisons": checked,
        "max_rel_diff": _fmt(worst),
        "modes": ["causal" if m else "non-causal" for m in modes],
        "unpadded_call_compared": removal_checked,
    }
    if problems:
        numbers["problems"] = problems[:6]
    return CheckResult(
        PaddingInvariance.rule,
        claim=(
            "padded keys (other values, 1e4, NaN) leave outputs and gradients; padded positions get zero gradient"
            + ("; the padded tail is as if absent" if removal_checked else "")
        ),
        numbers=numbers,
        verdict=verdict(not problems),
        **ids,
    )


def implied_engine_claims(entry: Any, declared: set[type]) -> list[Any]:
    """EN001 (feature-map attention: every feature map and every subclass of
    :class:`~kernelattn_core.FeatureMapAttention`), EN002 (causal support) and EN003 for
    an estimator or feature map, unless it declares its own."""
    from ..builtins.estimators import FeatureMapAttention

    if entry.kind not in ("estimator", "feature_map"):
        return []
    cls = entry.cls
    if entry.kind == "estimator" and inspect.isabstract(cls):
        return []
    out: list[Any] = []
    fma = entry.kind == "feature_map" or issubclass(cls, FeatureMapAttention)
    if fma and EngineReference not in declared:
        out.append(EngineReference())
    if PrefixInvariance not in declared and (entry.kind == "feature_map" or getattr(cls, "supports_causal", True)):
        out.append(PrefixInvariance())
    if PaddingInvariance not in declared:
        out.append(PaddingInvariance())
    return out


__all__ = [
    "build_estimator",
    "check_engine_reference",
    "check_padding_invariance",
    "check_prefix_invariance",
    "feature_map_reference",
    "implied_engine_claims",
    "small_groups",
]
