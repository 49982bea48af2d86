"""A non-finite value reaches the gradients of no row that does not see it.

Every registered causal estimator (feature maps through feature-map attention, kernels
through exact attention), built from the registry at collection time: a NaN key or value
at position 8 (seen by rows >= 8 only) or a NaN query in row 8 (its own row only). A loss
on the rows that do not see it must give finite gradients at every other position. Before
the quarantine, the NaN rows sent 0 * NaN back through their own normaliser (exact
attention, ``ra``, ``ra-biased``; a NaN query in ``rfa-gate`` and ``sliding-window``).
"""

from __future__ import annotations

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.testing.fuzz import make


def _causal_names() -> list[str]:
    names = []
    for entry in ka.get_registry().entries():
        if entry.kind in ("estimator", "feature_map", "kernel") and getattr(entry.cls, "supports_causal", True):
            names.append(entry.name)
    return sorted(names)


@pytest.mark.parametrize("where", ["k", "v", "q"])
@pytest.mark.parametrize("name", _causal_names())
def test_a_nan_reaches_no_gradient_of_a_row_that_does_not_see_it(name: str, where: str) -> None:
    try:
        est = make(ka.get_registry().get(name)).double().eval()
        if not getattr(est, "supports_causal", True):
            pytest.skip("non-causal estimator")
    except Exception as exc:  # a class that cannot be built with defaults is covered elsewhere
        pytest.skip(f"not buildable with defaults: {exc}")
    g = torch.Generator().manual_seed(0)
    q, k, v = (0.5 * torch.randn(1, 2, 12, 4, generator=g, dtype=torch.float64) for _ in range(3))
    {"q": q, "k": k, "v": v}[where][0, :, 8] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = est(q, k, v, causal=True)
    rows = torch.ones(12, dtype=torch.bool)
    rows[8 if where == "q" else slice(8, None)] = False  # the rows that see it
    assert bool(torch.isnan(out[:, :, ~rows]).all()), "a row that sees the NaN should be NaN"
    assert bool(torch.isfinite(out[:, :, rows]).all())
    grads = torch.autograd.grad(out[:, :, rows].sum(), (q, k, v), allow_unused=True)
    others = torch.ones(12, dtype=torch.bool)
    others[8] = False
    for arg, grad in zip("qkv", grads):
        if grad is not None:
            assert bool(torch.isfinite(grad[:, :, others]).all()), f"{name}: NaN in {arg}.grad of another position"


def _attention_names() -> list[str]:
    return sorted(e.name for e in ka.get_registry().entries() if e.kind in ("estimator", "feature_map", "kernel"))


def _cases(est) -> list[tuple[str, str, bool]]:  # type: ignore[no-untyped-def]
    """(mode, where, causal) this estimator can run: a future value (causal), a padded key
    or value (causal and not), a non-finite query row (its own row only)."""
    causal_ok = getattr(est, "supports_causal", True)
    full_ok = getattr(est, "supports_noncausal", True)
    out = []
    for where in "qkv":
        if causal_ok:
            out.append(("future", where, True))
            out.append(("query_row", "q", True)) if where == "q" else out.append(("padded", where, True))
        if full_ok:
            out.append(("query_row", "q", False)) if where == "q" else out.append(("padded", where, False))
    return out


@pytest.mark.parametrize("name", _attention_names())
def test_masked_and_future_non_finite_values_leave_every_other_gradient_finite(name: str) -> None:
    """Learned parameters included (learned maps, gates, normalisers); the offending
    position's own gradient is exactly 0, as exact attention gives it. Before this change
    456 such cases gave NaN parameter gradients and the feature-map estimators NaN (not
    0) at the offending position (issue 25)."""
    entry = ka.get_registry().get(name)
    problems = []
    for bad in (float("nan"), float("inf")):
        est = make(entry).double().train()
        for mode, where, causal in _cases(est):
            g = torch.Generator().manual_seed(1)
            q, k, v = (0.5 * torch.randn(2, 2, 10, 4, generator=g, dtype=torch.float64) for _ in range(3))
            t, mask, rows = 6, None, torch.ones(10, dtype=torch.bool)
            {"q": q, "k": k, "v": v}[where][0, :, t] = bad
            if mode == "padded":
                mask = torch.zeros(2, 10, dtype=torch.bool)
                mask[0, t] = True
            elif mode == "future":
                rows[t:] = False
            else:
                rows[t] = False
            leaves = [x.requires_grad_() for x in (q, k, v)]
            est(*leaves, causal=causal, key_padding_mask=mask)  # builds lazily made parameters
            named = [(n, p) for n, p in est.named_parameters() if p.requires_grad]
            out = est(*leaves, causal=causal, key_padding_mask=mask)
            label = f"{where}[{t}] = {bad} ({mode}, causal={causal})"
            if not bool(torch.isfinite(out[0][:, rows]).all() and torch.isfinite(out[1]).all()):
                problems.append(f"{label}: rows that do not see it are non-finite")
                continue
            loss = out[0][:, rows].sum() + out[1].sum()
            grads = torch.autograd.grad(loss, [*leaves, *(p for _, p in named)], allow_unused=True)
            for arg, grad in zip("qkv", grads[:3]):
                if grad is None:
                    continue
                others = torch.ones(2, 10, dtype=torch.bool)
                others[0, t] = False
                if not bool(torch.isfinite(grad.transpose(1, 2)[others]).all()):
                    problems.append(f"{label}: non-finite {arg}.grad at another position")
                if arg == where and not bool((grad[0, :, t] == 0).all()):
                    problems.append(
                        f"{label}: {arg}.grad at its own position is {grad[0, :, t].flatten()[:2].tolist()}"
                    )
            problems += [
                f"{label}: non-finite gradient of {n}"
                for (n, _), grad in zip(named, grads[3:])
                if grad is not None and not bool(torch.isfinite(grad).all())
            ]
    assert not problems, f"{name}: " + "\n".join(problems)


@pytest.mark.parametrize("name", ["trig-softmax-features", "trig-softmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_trig_keys_whose_features_overflow_are_dropped_with_zero_gradient(name: str, dtype: torch.dtype) -> None:
    """Finite keys a hundred times larger than the others: their factor e^{|k|^2/2}
    overflows. They are NaN rows (the rows that see them are NaN), and earlier rows'
    gradients are finite and zero at the large keys (they were NaN: 0 * inf in the
    exponential's backward)."""
    est = make(ka.get_registry().get(name)).to(dtype)
    g = torch.Generator().manual_seed(0)
    q, k, v = (0.5 * torch.randn(1, 2, 12, 4, generator=g, dtype=dtype) for _ in range(3))
    k[:, :, 8:] *= 100.0
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = est(q, k, v, causal=True)
    assert bool(torch.isnan(out[:, :, 8:]).all()) and bool(torch.isfinite(out[:, :, :8]).all())
    dq, dk, dv = torch.autograd.grad(out[:, :, :8].sum(), (q, k, v))
    assert all(bool(torch.isfinite(d).all()) for d in (dq, dk, dv))
    assert bool((dk[:, :, 8:] == 0).all()) and bool((dv[:, :, 8:] == 0).all())
