"""Statistical checks: Monte Carlo in float64 with fixed seeds.

Every z-test uses a threshold from :func:`~kernelattn_core.verify.result.z_threshold`,
so that all the tests of one check together fail by chance with probability below
1e-6 (Bonferroni). Seeds are fixed, so a run is reproducible bit for bit.

**Sensitivity.** Each Monte Carlo check reports ``min_detectable_rel_bias``: the
smallest relative error (a bias of the mean, or of the variance for FM003) that the
check detects with probability 0.95 at the level run,
:math:`(z_{\\text{thr}} + z_{0.95})\\,\\mathrm{se}/|\\text{target}|` on the most
sensitive pair. A defect smaller than that passes; run ``--level full`` (more draws,
and, for FM001 and FM002, head dimension 128 besides the declared ones) to look closer.

**No variance.** An FM001 pair whose estimates do not vary (a deterministic map, whose
redraws change nothing, or an input where every feature is the same) has no standard
error to divide by: it is checked for exactness instead, the relative difference of the
estimate from the kernel within :data:`EXACT_RTOL` (rounding), and its z-score is not
reported.

**Shapes first.** FM001 and FM003 check that :meth:`query` and :meth:`key` return
``[pairs, feature_dim]`` before any statistics, so a wrong shape is reported as a
shape error, not as a variance or bias failure.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..claims import (
    ConsistentAttention,
    ErrorDecay,
    EstimateVariance,
    PositiveFeatures,
    UnbiasedAttention,
    UnbiasedKernelEstimate,
)
from ..errors import InputError
from ..interfaces.feature_map import FeatureMap
from .result import CheckResult, verdict, z_threshold

SEED = 20_261_121
#: one-sided z for 95% power in the sensitivity figures
Z_POWER = 1.6448536269514722
#: head dimension ``--level full`` adds to every FM001-FM003 claim (defects that appear only for large d)
FULL_LEVEL_DIM = 128
#: FM001 on a pair without variance (its standard error below :data:`NO_VARIANCE_RTOL` of the
#: kernel, rounding noise): the estimate must equal the kernel within this relative
#: tolerance (float64 rounding of a feature sum is far below it; a bias of a map is far above)
EXACT_RTOL = 1e-9
#: a pair's standard error at most this fraction of ``|K|`` is rounding noise, not variance
NO_VARIANCE_RTOL = 1e-12


def _scaled(level: str, full: int, quick_floor: int = 200) -> int:
    """Sample count at ``level``: the declared count at full, half of it (at least
    ``quick_floor``) at quick."""
    return full if level == "full" else max(min(full, quick_floor), full // 2)


def _dims(level: str, dims: tuple[int, ...], extra: tuple[int, ...] = (), large: bool = True) -> tuple[int, ...]:
    """Head dimensions at ``level``: the first declared at quick; at full every declared
    one, those the class declares in ``verify_dims``, and (``large``) :data:`FULL_LEVEL_DIM`.
    FM003 (tens of thousands of draws) keeps its declared dimensions to bound the time."""
    if level != "full":
        return dims[:1]
    return tuple(sorted(set(dims) | set(extra) | ({FULL_LEVEL_DIM} if large else set())))


def _class_dims(cls: Any) -> tuple[int, ...]:
    return tuple(getattr(cls, "verify_dims", ()) or ())


class ShapeError(Exception):
    """A feature map returned features of the wrong shape (reported before any statistics)."""


def check_shapes(fm: FeatureMap, x: torch.Tensor) -> None:
    """Raise :class:`ShapeError` unless ``query(x)`` and ``key(x)`` are ``[*x.shape[:-1], feature_dim]``."""
    with torch.no_grad():
        for side, out in (("query", fm.query(x)), ("key", fm.key(x))):
            expected = (*x.shape[:-1], fm.feature_dim)
            if tuple(out.shape) != expected:
                raise ShapeError(
                    f"{side}(x) returned shape {tuple(out.shape)} for x {tuple(x.shape)}; expected {expected} "
                    f"([..., feature_dim]); statistics skipped"
                )


def _shape_failure(rule: str, exc: ShapeError, **ids: str) -> CheckResult:
    return CheckResult(rule, claim="feature shapes (checked first)", numbers={"shape_error": str(exc)}, **ids)


def _sensitivity(threshold: float, se: torch.Tensor, target: torch.Tensor) -> float:
    """Smallest relative error detected with probability 0.95 on the most sensitive element."""
    rel = (threshold + Z_POWER) * se / target.abs().clamp_min(1e-300)
    return float(f"{float(rel.min()):.3g}")


def make_map(cls: type[FeatureMap], d: int, num_features: int, options: Any) -> FeatureMap:
    fm = cls(num_features=num_features, **dict(options))
    fm.build(d, generator=torch.Generator().manual_seed(SEED))
    return fm.double()


def make_map_at(
    cls: type[FeatureMap], d: int, num_features: int, options: Any, declared: tuple[int, ...]
) -> tuple[FeatureMap, int]:
    """:func:`make_map`, and the budget used. At a dimension the claim does not declare
    (the added :data:`FULL_LEVEL_DIM`), a map that refuses the declared budget for this
    ``d`` (FastFood stacks ``d x d`` blocks: a multiple of ``d``) gets the smallest
    multiple of ``d`` above it; a refusal at a declared dimension stays an error."""
    try:
        return make_map(cls, d, num_features, options), num_features
    except InputError:
        if d in declared:
            raise
        budget = -(-num_features // d) * d
        return make_map(cls, d, budget, options), budget


def sample_points(
    d: int, pairs: int, norm_range: tuple[float, float], seed: int, inputs: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pairs`` point pairs ``[pairs, d]``: unit directions with norms uniform in ``norm_range``."""
    g = torch.Generator().manual_seed(seed)
    if inputs is not None:
        return inputs(d, pairs, g)
    lo, hi = norm_range
    out = []
    for _ in range(2):
        u = torch.randn(pairs, d, generator=g, dtype=torch.float64)
        r = lo + (hi - lo) * torch.rand(pairs, 1, generator=g, dtype=torch.float64)
        out.append(u / u.norm(dim=-1, keepdim=True) * r)
    return out[0], out[1]


def pair_estimates(fm: FeatureMap, x: torch.Tensor, y: torch.Tensor, redraws: int, seed: int) -> torch.Tensor:
    """``[redraws, pairs]`` single-pair estimates :math:`\\phi_q(x_i)^\\top \\phi_k(y_i)`."""
    rows = []
    with torch.no_grad():
        for r in range(redraws):
            fm.redraw(generator=torch.Generator().manual_seed(seed + r))
            rows.append((fm.query(x) * fm.key(y)).sum(-1))
    return torch.stack(rows)


def exact_pairs(fm: FeatureMap, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[pairs]`` exact :math:`K(x_i, y_i)`."""
    with torch.no_grad():
        return fm.exact_kernel(x.unsqueeze(-2), y.unsqueeze(-2)).reshape(-1)


def unbiased_pairs(
    est: torch.Tensor, target: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FM001's per-pair test of estimates ``est [redraws, pairs]`` against ``target [pairs]``.

    A pair with variance gets the z-test (:math:`|\\bar x - K| / \\mathrm{se}` below
    ``threshold``); a pair without (standard error at most :data:`NO_VARIANCE_RTOL` of
    :math:`|K|`: a deterministic map, or inputs where every draw agrees) the exactness test
    (relative difference within :data:`EXACT_RTOL`), since dividing its rounding error by
    a zero standard error would give a meaningless z-score.

    Returns
    -------
    z : Tensor ``[pairs]``
        z-scores, 0 for the pairs without variance.
    rel : Tensor ``[pairs]``
        Relative differences :math:`|\\bar x - K| / |K|`.
    exact : Tensor ``[pairs]`` of bool
        Which pairs had no variance.
    ok : Tensor ``[pairs]`` of bool
        Which pairs passed their test.
    """
    redraws = est.shape[0]
    mean = est.mean(0)
    se = est.std(0) / math.sqrt(redraws) if redraws > 1 else torch.zeros_like(mean)
    diff = (mean - target).abs()
    scale = torch.maximum(target.abs(), mean.abs())
    exact = se <= NO_VARIANCE_RTOL * target.abs()
    z = torch.where(exact, torch.zeros_like(diff), diff / se.clamp_min(1e-300))
    rel = diff / target.abs().clamp_min(1e-300)
    ok = torch.where(exact, diff <= EXACT_RTOL * scale, z < threshold) & torch.isfinite(est).all(0)
    return z, rel, exact, ok


def check_unbiased(cls: type[FeatureMap], claim: UnbiasedKernelEstimate, level: str, **ids: str) -> CheckResult:
    """FM001: per-pair z-scores of the Monte Carlo mean against the exact kernel; a pair
    whose estimate has no variance (a deterministic map) is checked for exactness
    instead (:func:`unbiased_pairs`)."""
    dims = _dims(level, claim.dims, _class_dims(cls), large=not claim.point)  # grid points: declared dims
    redraws = _scaled(level, claim.redraws)
    threshold = z_threshold(len(dims) * claim.pairs)
    worst_z, worst_rel, ok = 0.0, 0.0, True
    sensitivity = math.inf
    exact_pairs_seen = 0
    per_dim: dict[str, Any] = {}
    for d in dims:
        try:
            fm, budget = make_map_at(cls, d, claim.num_features, claim.options, claim.dims)
        except InputError as exc:
            if d in claim.dims:
                raise
            per_dim[f"skipped_d{d}"] = f"options refused at d = {d}: {exc}"  # d-specific options (a [d, d] matrix)
            continue
        if budget != claim.num_features:
            per_dim[f"num_features_d{d}"] = budget
        if claim.setup is not None:
            claim.setup(fm, torch.Generator().manual_seed(SEED + 5 * d))
        x, y = sample_points(d, claim.pairs, claim.norm_range, SEED + d, claim.inputs)
        try:
            check_shapes(fm, x)
        except ShapeError as exc:
            return _shape_failure(UnbiasedKernelEstimate.rule, exc, **ids)
        # the added large dimension runs a quarter of the draws (it looks for defects that
        # appear only at large d, not for small biases); its sensitivity is reported with the rest
        r_d = redraws if d in claim.dims or d != FULL_LEVEL_DIM else max(redraws // 4, 100)
        est = pair_estimates(fm, x, y, r_d, SEED + 1000 * d)
        target = exact_pairs(fm, x, y)
        z, rel, exact, passed = unbiased_pairs(est, target, threshold)
        if bool(exact.all()):
            per_dim[f"max_rel_diff_d{d}"] = float(f"{float(rel.max()):.3g}")
        else:
            per_dim[f"max_z_d{d}"] = round(float(z.max()), 3)
        if r_d != redraws:
            per_dim[f"redraws_d{d}"] = r_d
        if not bool(exact.all()):
            se = est.std(0)[~exact] / math.sqrt(r_d)
            sensitivity = min(sensitivity, _sensitivity(threshold, se, target[~exact]))
        if bool(exact.any()):
            sensitivity = min(sensitivity, EXACT_RTOL)
        exact_pairs_seen += int(exact.sum())
        worst_z, worst_rel = max(worst_z, float(z.max())), max(worst_rel, float(rel.max()))
        ok &= bool(passed.all())
    numbers: dict[str, Any] = {
        "max_abs_z": round(worst_z, 3),
        "z_threshold": round(threshold, 3),
        "max_rel_bias": float(f"{worst_rel:.3g}"),
        "min_detectable_rel_bias": sensitivity,
        "redraws": redraws,
        "num_features": claim.num_features,
        "pairs": claim.pairs,
    }
    if exact_pairs_seen:
        numbers["pairs_without_variance"] = exact_pairs_seen
        numbers["exact_rtol"] = EXACT_RTOL
    numbers.update(per_dim)
    text = f"E[phi_q(x).phi_k(y)] == K(x, y), d in {list(dims)}, |x|,|y| in {list(claim.norm_range)}"
    if exact_pairs_seen:
        text += f" (pairs without variance: equal within rel. {EXACT_RTOL:g})"
    return CheckResult(
        UnbiasedKernelEstimate.rule,
        claim=text,
        numbers=numbers,
        verdict=verdict(ok),
        **ids,
    )


def check_positive(cls: type[FeatureMap], claim: PositiveFeatures, level: str, **ids: str) -> CheckResult:
    """FM002: every feature of :meth:`query` and :meth:`key` (what attention uses) is
    finite and :math:`> 0`, over many draws and inputs up to ``max_norm``.

    On a log-space map the stated form is vacuous (deprecated since spec 1.1, see
    :data:`kernelattn_core.claims.spec.DEPRECATIONS`); its meaningful form is checked
    instead: every log-feature (:meth:`raw_features`) is finite, so every feature is a
    finite number :math:`> 0` (a log-feature of :math:`-\\infty` is a zero feature, NaN or
    :math:`+\\infty` a broken one)."""
    log_space = bool(getattr(cls, "log_space", False))
    redraws = _scaled(level, claim.redraws, quick_floor=10)
    worst, count, bad = math.inf, 0, 0
    for d in _dims(level, claim.dims, _class_dims(cls), large=not claim.point):
        fm, _ = make_map_at(cls, d, 64, claim.options, claim.dims)
        g = torch.Generator().manual_seed(SEED + d)
        x = torch.randn(256, d, generator=g, dtype=torch.float64)
        x = x / x.norm(dim=-1, keepdim=True) * torch.linspace(0, claim.max_norm, 256, dtype=torch.float64)[:, None]
        with torch.no_grad():
            for r in range(redraws):
                fm.redraw(generator=torch.Generator().manual_seed(SEED + r))
                if log_space:
                    sides = (fm.raw_features(x, query=True), fm.raw_features(x, query=False))
                else:
                    sides = (fm.query(x), fm.key(x))
                for feats in sides:
                    ok_mask = torch.isfinite(feats) if log_space else torch.isfinite(feats) & (feats > 0)
                    bad += int((~ok_mask).sum())
                    worst = min(worst, float(feats.nan_to_num(nan=-math.inf).min()))
                    count += feats.numel()
    if log_space:
        return CheckResult(
            PositiveFeatures.rule,
            claim=(
                f"every log-feature of query(x), key(x) is finite (features finite and > 0) for |x| <= {claim.max_norm}"
            ),
            numbers={"log_features_checked": count, "non_finite": bad, "min_log_feature": float(f"{worst:.3g}")},
            verdict=verdict(bad == 0),
            **ids,
        )
    return CheckResult(
        PositiveFeatures.rule,
        claim=f"every feature of query(x), key(x) is finite and > 0 for |x| <= {claim.max_norm}",
        numbers={"features_checked": count, "non_positive_or_nonfinite": bad, "min_feature": float(f"{worst:.3g}")},
        verdict=verdict(bad == 0 and worst > 0),
        **ids,
    )


def check_variance(cls: type[FeatureMap], claim: EstimateVariance, level: str, **ids: str) -> CheckResult:
    """FM003: sample variance of the single-pair estimate against the closed form.

    The standard error of a sample variance is :math:`\\sqrt{(\\mu_4 - \\sigma^4)/R}`
    with the fourth central moment :math:`\\mu_4` estimated from the same draws.
    """
    if claim.variance is None:
        raise ValueError("EstimateVariance.variance is not set")
    dims = _dims(level, claim.dims, _class_dims(cls), large=False)
    redraws = _scaled(level, claim.redraws, quick_floor=4000)
    threshold = z_threshold(len(dims) * claim.pairs)
    worst_z, worst_ratio = 0.0, 1.0
    sensitivity = math.inf
    ok = True
    for d in dims:
        fm = make_map(cls, d, claim.num_features, claim.options)
        if claim.setup is not None:
            claim.setup(fm, torch.Generator().manual_seed(SEED + 5 * d))
        x, y = sample_points(d, claim.pairs, claim.norm_range, SEED + 7 * d, claim.inputs)
        try:
            check_shapes(fm, x)
        except ShapeError as exc:
            return _shape_failure(EstimateVariance.rule, exc, **ids)
        est = pair_estimates(fm, x, y, redraws, SEED + 3000 * d)
        with torch.no_grad():
            declared = torch.as_tensor(claim.variance(x, y, fm), dtype=torch.float64).reshape(-1)
        centred = est - est.mean(0)
        sample_var = centred.pow(2).mean(0) * redraws / (redraws - 1)
        mu4 = centred.pow(4).mean(0)
        se = ((mu4 - sample_var**2).clamp_min(0) / redraws).sqrt()
        z = ((sample_var - declared) / se.clamp_min(1e-300)).abs()
        ratio = (sample_var / declared.clamp_min(1e-300)).tolist()
        worst_z = max(worst_z, float(z.max()))
        sensitivity = min(sensitivity, _sensitivity(threshold, se, declared))
        worst_ratio = max(ratio, key=lambda r: abs(math.log(r)) if r > 0 else math.inf)
        ok &= float(z.max()) < threshold
    return CheckResult(
        EstimateVariance.rule,
        claim=f"Var[phi_q(x).phi_k(y)] == closed form, D = {claim.num_features}, d in {list(dims)}",
        numbers={
            "max_abs_z": round(worst_z, 3),
            "z_threshold": round(threshold, 3),
            "worst_sample_over_declared": float(f"{worst_ratio:.4g}"),
            "min_detectable_rel_error": sensitivity,
            "redraws": redraws,
        },
        verdict=verdict(ok),
        **ids,
    )


def check_error_decay(cls: type[FeatureMap], claim: ErrorDecay, level: str, **ids: str) -> CheckResult:
    """FM004: least-squares slope of log kernel MSE against log D."""
    redraws = _scaled(level, claim.redraws, quick_floor=100)
    x, y = sample_points(claim.dim, 16, claim.norm_range, SEED + 11)
    mses = []
    for m in claim.budgets:
        fm = make_map(cls, claim.dim, m, claim.options)
        est = pair_estimates(fm, x, y, redraws, SEED + 17 * m)
        target = exact_pairs(fm, x, y)
        mses.append(float(((est - target) ** 2).mean()))
    lx = [math.log(m) for m in claim.budgets]
    ly = [math.log(e) for e in mses]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    slope = sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)
    return CheckResult(
        ErrorDecay.rule,
        claim=f"kernel MSE ~ D^{claim.slope} over D in {list(claim.budgets)}",
        numbers={
            "slope": round(slope, 3),
            "expected_slope": claim.slope,
            "tolerance": claim.tolerance,
            **{f"mse_D{m}": float(f"{e:.3g}") for m, e in zip(claim.budgets, mses)},
        },
        verdict=verdict(abs(slope - claim.slope) <= claim.tolerance),
        **ids,
    )


def _attention_inputs(
    dim: int, seq_len: int, logit_std: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (1, 1, seq_len, dim)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
    return q * math.sqrt(logit_std), k * math.sqrt(logit_std), v


def _factory(entry: Any) -> Any:
    """``(budget, options) -> estimator`` for a registry entry: :func:`create` by name when
    the registry holds this very class, else the class itself (a mutant in the tests)."""
    from ..api import create
    from ..registry import get_registry

    name = entry if isinstance(entry, str) else entry.name
    try:
        registered = get_registry().get(name).cls
    except Exception:
        registered = None
    if isinstance(entry, str) or registered is entry.cls:
        return lambda budget, options: create(name, num_features=budget, **dict(options))
    return lambda budget, options: entry.cls(num_features=budget, **dict(options))


def attention_draws(
    entry: Any,
    budget: int,
    options: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    redraws: int,
    seed: int,
    mode: str = "train",
) -> torch.Tensor:
    """``[redraws, N, dv]`` outputs of independently seeded estimators in ``mode``
    (``"train"`` or ``"eval"``); ``entry`` is a registry entry or name."""
    if mode not in ("train", "eval"):
        raise ValueError(f"mode: expected 'train' or 'eval', got {mode!r}")
    make = _factory(entry)
    outs = []
    with torch.no_grad():
        for r in range(redraws):
            torch.manual_seed(seed + r)
            est = make(budget, options).double().train(mode == "train")
            outs.append(est(q, k, v)[0, 0])
    return torch.stack(outs)


def check_unbiased_attention(name: Any, claim: UnbiasedAttention, level: str, **ids: str) -> CheckResult:
    """AT001: element-wise z-scores of the mean output against exact softmax attention."""
    from ..api import create

    redraws = _scaled(level, claim.redraws)
    q, k, v = _attention_inputs(claim.dim, claim.seq_len, claim.logit_std, SEED)
    exact = create("softmax")(q, k, v)[0, 0]
    outs = attention_draws(name, claim.num_features, claim.options, q, k, v, redraws, SEED, claim.mode)
    mean, se = outs.mean(0), outs.std(0) / math.sqrt(redraws)
    z = ((mean - exact) / se.clamp_min(1e-300)).abs()
    threshold = z_threshold(exact.numel())
    sensitivity = _sensitivity(threshold, se, exact)
    return CheckResult(
        UnbiasedAttention.rule,
        claim=(
            f"E[output] == softmax attention (d={claim.dim}, N={claim.seq_len}, budget {claim.num_features}, "
            f"{claim.mode} mode)"
        ),
        numbers={
            "max_abs_z": round(float(z.max()), 3),
            "z_threshold": round(threshold, 3),
            "max_abs_bias": float(f"{float((mean - exact).abs().max()):.3g}"),
            "min_detectable_rel_bias": sensitivity,
            "redraws": redraws,
        },
        verdict=verdict(float(z.max()) < threshold),
        **ids,
    )


def at002_budgets(declared: tuple[int, ...]) -> tuple[int, ...]:
    """The budgets AT002 runs: the declared ones when there are at least four, else five
    geometrically spaced budgets from the smallest to the largest declared (spec 1.0's
    ``(4, 64)`` becomes ``(4, 8, 16, 32, 64)``)."""
    unique = sorted(set(int(b) for b in declared))
    if len(unique) >= 4:
        return tuple(unique)
    lo, hi = unique[0], unique[-1]
    if hi <= lo:
        raise ValueError(f"AT002: budgets must span a range, got {declared}")
    ratio = (hi / lo) ** 0.25
    return tuple(sorted({round(lo * ratio**i) for i in range(5)}))


def _row_draws(
    entry: Any, budget: int, options: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, redraws: int, seed: int
) -> torch.Tensor:
    """``[redraws, N, dv]`` outputs drawn as the batch rows of a few calls (an estimator
    that draws independently per batch row), 100 rows per call."""
    make = _factory(entry)
    outs, call = [], 0
    with torch.no_grad():
        while sum(o.shape[0] for o in outs) < redraws:
            rows = min(100, redraws - sum(o.shape[0] for o in outs))
            torch.manual_seed(seed + call)
            est = make(budget, options).double().train(True)
            out = est(q.expand(rows, -1, -1, -1), k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1))
            outs.append(out[:, 0])
            call += 1
    return torch.cat(outs)


def _bias2(outs: torch.Tensor, exact: torch.Tensor) -> float:
    """Estimate of the mean squared bias over the elements, the variance of the mean removed."""
    r = outs.shape[0]
    mean = outs.mean(0)
    return float(((mean - exact) ** 2 - outs.var(0) / r).mean())


def _jackknife_se(outs: torch.Tensor, exact: torch.Tensor, groups: int = 20) -> float:
    """Delete-a-group jackknife standard error of :func:`_bias2` (valid whatever the
    correlation between output elements)."""
    r = outs.shape[0]
    groups = min(groups, r // 2)
    idx = torch.arange(r)
    values = [_bias2(outs[idx % groups != g], exact) for g in range(groups)]
    mean = sum(values) / groups
    return math.sqrt((groups - 1) / groups * sum((x - mean) ** 2 for x in values))


def check_consistent_attention(name: Any, claim: ConsistentAttention, level: str, **ids: str) -> CheckResult:
    """AT002 as a rate (see :class:`~kernelattn_core.claims.ConsistentAttention`): the
    extrapolated limit of the mean output, the slope of the RMS bias in the budget, the
    mean squared error at every budget, and the bias at the smallest budget."""
    from ..api import create

    budgets = at002_budgets(claim.budgets)
    redraws = _scaled(level, claim.redraws, quick_floor=200)
    q, k, v = _attention_inputs(claim.dim, claim.seq_len, claim.logit_std, SEED + 1)
    exact = create("softmax")(q, k, v)[0, 0].reshape(-1)  # [P]
    p = exact.numel()
    means, var_means, scalar_vars, mse, bias2, bias2_se, bias_z = [], [], [], [], [], [], []
    for budget in budgets:
        seed = SEED + 97 * budget
        if claim.independent_rows:
            outs = _row_draws(name, budget, claim.options, q, k, v, redraws, seed)
        else:
            outs = attention_draws(name, budget, claim.options, q, k, v, redraws, seed)
        outs = outs.reshape(redraws, -1)  # [R, P]
        mean, var = outs.mean(0), outs.var(0)
        means.append(mean)
        var_means.append(var / redraws)
        scalar_vars.append(float(outs.mean(1).var()) / redraws)  # the mean over elements, per draw
        mse.append(float(((outs - exact) ** 2).mean()))
        bias2.append(_bias2(outs, exact))
        bias2_se.append(_jackknife_se(outs, exact))
        bias_z.append(float(((mean - exact) / (var / redraws).sqrt().clamp_min(1e-300)).abs().max()))
    # ---- slope of the RMS bias over the budgets where it is resolved
    resolved = [i for i, (b2, se) in enumerate(zip(bias2, bias2_se)) if b2 > 2 * se and b2 > 0]
    slope = slope_se = None
    slope_ok = True
    if len(resolved) >= 2:
        lx = [math.log(budgets[i]) for i in resolved]
        ly = [0.5 * math.log(bias2[i]) for i in resolved]
        wt = [1.0 / max((bias2_se[i] / (2 * bias2[i])) ** 2, 1e-12) for i in resolved]  # var of log b = (se/2b^2)^2
        s0, s1, s2 = sum(wt), sum(a * x for a, x in zip(wt, lx)), sum(a * x * x for a, x in zip(wt, lx))
        sy, sxy = sum(a * y for a, y in zip(wt, ly)), sum(a * x * y for a, x, y in zip(wt, lx, ly))
        dd = s0 * s2 - s1 * s1
        slope = (s0 * sxy - s1 * sy) / dd
        slope_se = math.sqrt(s0 / dd)
        slope_ok = slope - z_threshold(1) * slope_se <= -claim.order
    # ---- limit: weighted least squares of the mean on x = D^-order per element (the
    # slowest decay the claim allows). A bias that falls faster is convex in x, so its fit
    # can only carry the extrapolated limit across zero, to the side opposite the bias
    # left at the largest budget; a limit on the side of that bias is what a wrong limit
    # leaves, and only that side fails (two-sided threshold: the sign is read from data)
    xs = [float(b) ** -claim.order for b in budgets]
    w = [1.0 / max(float(vm.mean()), 1e-30) for vm in var_means]  # pooled precision of each budget's mean
    sw, swx, swxx = sum(w), sum(a * x for a, x in zip(w, xs)), sum(a * x * x for a, x in zip(w, xs))
    det = sw * swxx - swx * swx
    coef = [a * (swxx - swx * x) / det for a, x in zip(w, xs)]  # intercept = sum_i coef_i * mean_i
    limit = sum(c * m for c, m in zip(coef, means)) - exact  # [P]
    limit_se = sum(c * c * vm for c, vm in zip(coef, var_means)).sqrt()  # [P]
    last = means[-1] - exact  # the bias left at the largest budget
    mean_bias = float(limit.mean())
    mean_se = math.sqrt(sum(c * c * sv for c, sv in zip(coef, scalar_vars)))
    threshold = z_threshold(p + 1)  # every element and their mean
    limit_z = float((limit * last.sign() / limit_se.clamp_min(1e-300)).max().clamp_min(0.0))
    mean_z = max(mean_bias * math.copysign(1.0, float(last.mean())), 0.0) / max(mean_se, 1e-300)
    limit_ok = limit_z < threshold and mean_z < threshold
    limit_rms = math.sqrt(max(float((limit**2 - limit_se**2).mean()), 0.0))
    # ---- error and the bias at the smallest budget
    # the error falls: its log-log slope is negative and the largest budget halves it
    # (not step by step: heavy-tailed features such as random Maclaurin ones have rare
    # huge draws that make one budget's MSE jump)
    lm = [math.log(max(e, 1e-300)) for e in mse]
    lb = [math.log(b) for b in budgets]
    mb, mm = sum(lb) / len(lb), sum(lm) / len(lm)
    mse_slope = sum((x - mb) * (y - mm) for x, y in zip(lb, lm)) / sum((x - mb) ** 2 for x in lb)
    mse_ok = mse_slope < 0 and mse[-1] < 0.5 * mse[0]
    bias_threshold = z_threshold(p)
    bias_detected = bias_z[0] > bias_threshold
    bias_ok = claim.biased_at_finite_budget is None or bias_detected == claim.biased_at_finite_budget
    ok = limit_ok and slope_ok and mse_ok and bias_ok
    power = threshold + Z_POWER
    numbers: dict[str, Any] = {
        "budgets": list(budgets),
        "limit_bias_max_z": round(limit_z, 2),
        "limit_bias_mean": float(f"{mean_bias:.3g}"),
        "limit_bias_mean_z": round(mean_z, 2),
        "limit_bias_rms": float(f"{limit_rms:.3g}"),
        "z_threshold": round(threshold, 3),
        # the same shift of every element is caught by the test of the mean or by that of
        # its most sensitive element alone, whichever resolves it first (outputs that move
        # together, as with heavy-tailed features, make the mean the less sensitive one)
        "min_detectable_limit_bias": float(f"{power * min(mean_se, float(limit_se.min())):.3g}"),
        "min_detectable_limit_bias_mean": float(f"{power * mean_se:.3g}"),
        # a limit bias on one element only, whichever it is (the least sensitive one)
        "min_detectable_limit_bias_any_element": float(f"{power * float(limit_se.max()):.3g}"),
        "bias_slope": None if slope is None else round(slope, 3),
        "bias_slope_se": None if slope_se is None else round(slope_se, 3),
        "max_slope": -claim.order,
        "slope_budgets_resolved": [budgets[i] for i in resolved],
        "slope_tested": len(resolved) >= 2,
        **{f"bias_rms_D{b}": float(f"{math.sqrt(max(x, 0.0)):.3g}") for b, x in zip(budgets, bias2)},
        **{f"mse_D{b}": float(f"{e:.3g}") for b, e in zip(budgets, mse)},
        "mse_slope": round(mse_slope, 3),
        "bias_max_z_smallest_budget": round(bias_z[0], 2),
        "bias_detected_smallest_budget": bias_detected,
        "redraws": redraws,
    }
    failing = [
        name
        for name, good in (("limit", limit_ok), ("slope", slope_ok), ("mse", mse_ok), ("smallest-budget bias", bias_ok))
        if not good
    ]
    if failing:
        numbers["failed"] = failing
    statement = (
        "; bias at the smallest budget detected (biased at finite budget)"
        if claim.biased_at_finite_budget
        else "; no bias detected at the smallest budget"
        if claim.biased_at_finite_budget is False
        else ""
    )
    slope_text = (
        f"bias slope <= {-claim.order:g}"
        if len(resolved) >= 2
        else f"bias slope not tested (a bias resolved at {len(resolved)} of {len(budgets)} budgets: no slope to fit)"
    )
    return CheckResult(
        ConsistentAttention.rule,
        claim=(
            f"limit of E[output] over D in {list(budgets)} == softmax attention, {slope_text}, "
            f"MSE falls (log-log slope < 0, largest budget <= half the smallest's){statement}"
        ),
        numbers=numbers,
        verdict=verdict(ok),
        **ids,
    )
