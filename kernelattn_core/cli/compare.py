"""``kernelattn compare``: every installed estimator on an embedded workload.

Workload: synthetic ``q, k, v [B, H, N, 64]`` in three regimes,

* ``unit``: rows of q and k of unit norm (small logits);
* ``gauss-0.5``: Gaussian rows whose logits :math:`\\langle q, k\\rangle/\\sqrt{d}` have
  standard deviation 0.5 (entries :math:`\\mathcal{N}(0, 0.5)`);
* ``gauss-1.0``: the same with logit standard deviation 1.0.

For each estimator, regime and budget ``num_features``: kernel relative MSE
:math:`\\sum (\\hat K - K)^2 / \\sum K^2` (feature maps with a target kernel),
attention output relative error :math:`\\|\\hat o - o\\|_F / \\|o\\|_F` against exact
attention with the estimator's target kernel (softmax when it has none), forward
time (median) and peak tensor memory. Errors are averaged over the seeds.

Each estimator first sees its workload once in training mode, without gradients, as a
model is fitted before it is evaluated: data-adapted maps (CEXP) set their statistics
and batch-norm layers their running estimates. Measurements are then taken in eval mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..api import create
from ..builtins.estimators import ExactAttention, FeatureMapAttention
from ..builtins.kernels import SoftmaxKernel
from ..interfaces.kernel import Kernel
from ..registry import get_registry
from .measure import median_time, peak_memory
from .progress import Progress

HEAD_DIM = 64
REGIMES: dict[str, float | None] = {"unit": None, "gauss-0.5": 0.5, "gauss-1.0": 1.0}
DEFAULT_BUDGETS = (16, 64, 256, 1024)
COLUMNS = (
    "estimator",
    "regime",
    "budget",
    "kernel_rel_mse",
    "attn_rel_error",
    "time_ms",
    "time_vs_exact",
    "peak_mem_mb",
    "backend",
    "error",
)


def workload(
    regime: str, seq_len: int, *, batch: int = 1, heads: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The synthetic ``(q, k, v)`` of one regime, each ``[batch, heads, seq_len, 64]``."""
    g = torch.Generator().manual_seed(10_007 * seed + 17)
    shape = (batch, heads, seq_len, HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
    logit_std = REGIMES[regime]
    if logit_std is None:
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    else:  # std of <q,k>/sqrt(d) is sigma^2 for entries N(0, sigma^2)
        q, k = q * math.sqrt(logit_std), k * math.sqrt(logit_std)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def default_estimators() -> list[str]:
    """Every feature map and estimator, except the generic ``feature-map`` wrapper."""
    reg = get_registry()
    return [e.name for e in reg.entries("estimator") if e.name != "feature-map"] + reg.names("feature_map")


def _has_budget(name: str) -> bool:
    entry = get_registry().get(name)
    return bool(getattr(entry.cls, "has_budget", False))


def _target_kernel(estimator: Any) -> Kernel:
    """The exact kernel an estimator targets, as configured; softmax when it has none."""
    if isinstance(estimator, FeatureMapAttention) and estimator.feature_map.kernel is not None:
        return estimator.feature_map.target_kernel()
    kernel = getattr(estimator, "kernel", None)
    return kernel if isinstance(kernel, Kernel) else SoftmaxKernel()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(b.dtype).tiny))


def run_compare(
    estimators: Sequence[str] | None = None,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    *,
    seq_len: int = 256,
    causal: bool = False,
    seeds: Sequence[int] = (0,),
    regimes: Sequence[str] = tuple(REGIMES),
    progress: bool = True,
    repeats: int = 3,
) -> list[dict[str, Any]]:
    """One record per (estimator, regime, budget); see the module docstring."""
    names = list(estimators) if estimators else default_estimators()
    reg = get_registry()
    for name in names:
        reg.get(name)  # unknown names fail early, listing the available ones
    plan = [(n, r, b) for r in regimes for n in names for b in (budgets if _has_budget(n) else (None,))]
    records: list[dict[str, Any]] = []
    exact_time: dict[str, float] = {}
    with Progress(len(plan), "compare", enabled=progress) as bar:
        for name, regime, budget in plan:
            records.append(_one(name, regime, budget, seq_len, causal, seeds, repeats, exact_time))
            bar.advance(f"{name} {regime} {budget or ''}")
    for r in records:
        base = exact_time.get(r["regime"])
        r["time_vs_exact"] = r["time_ms"] / base if base and r.get("time_ms") is not None else None
    return records


def _one(
    name: str,
    regime: str,
    budget: int | None,
    seq_len: int,
    causal: bool,
    seeds: Sequence[int],
    repeats: int,
    exact_time: dict[str, float],
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "estimator": name,
        "regime": regime,
        "budget": budget,
        "seq_len": seq_len,
        "causal": causal,
        "seeds": list(seeds),
        "kernel": None,
        "kernel_rel_mse": None,
        "attn_rel_error": None,
        "time_ms": None,
        "time_vs_exact": None,
        "peak_mem_mb": None,
        "backend": None,
        "error": None,
    }
    kernel_errs, attn_errs = [], []
    try:
        for i, seed in enumerate(seeds):
            torch.manual_seed(seed)
            options = {} if budget is None else {"num_features": budget}
            est = create(name, **options)
            q, k, v = workload(regime, seq_len, seed=seed)
            with torch.no_grad():
                est.train()(q, k, v, causal=causal)  # calibration pass: data-adapted maps fit statistics
                est.eval()
                target = _target_kernel(est)  # after the first call: a learned target needs a built map
                record["kernel"] = target.name
                out = est(q, k, v, causal=causal)
                ref = ExactAttention(target)(q.double(), k.double(), v.double(), causal=causal)
                if not torch.isfinite(out).all():
                    raise FloatingPointError("output has non-finite values")
                attn_errs.append(_rel(out.double(), ref))
                if isinstance(est, FeatureMapAttention) and est.feature_map.kernel is not None:
                    qs, ks = est.transform(q[..., :128, :], k[..., :128, :])
                    exact_k = est.feature_map.exact_kernel(qs, ks).double()
                    approx = est.feature_map.kernel_estimate(qs, ks).double()
                    kernel_errs.append(float(((approx - exact_k) ** 2).mean() / (exact_k**2).mean()))
                if i == 0:
                    record["backend"] = est.last_backend

                    def call(est=est, q=q, k=k, v=v) -> torch.Tensor:
                        return est(q, k, v, causal=causal)

                    record["time_ms"] = 1e3 * median_time(call, q.device, repeats)
                    record["peak_mem_mb"] = peak_memory(call, q.device) / 2**20
                    if name == "exact":
                        exact_time[regime] = record["time_ms"]
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["attn_rel_error"] = sum(attn_errs) / len(attn_errs) if attn_errs else None
    record["kernel_rel_mse"] = sum(kernel_errs) / len(kernel_errs) if kernel_errs else None
    return record
