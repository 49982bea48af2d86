"""sliding-window: the blocked and the dense path against the quadratic reference (outputs
and gradients), masks, causality, the exact limit, budgets and errors.

The estimator-level tests run twice (the ``path`` fixture): short inputs take the dense
path (:data:`~kernelattn_hybrid.window.DENSE_MAX_PAIRS`), so each is also run with the
blocked path forced."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernelattn_hybrid import SlidingWindowAttention
from kernelattn_hybrid import window as win
from kernelattn_hybrid.naive import exact_sets, window_attention_naive
from kernelattn_hybrid.window import window_attention_blocked, window_attention_dense

import kernelattn_core as ka
from kernelattn_core.toolkit import InputError

F64 = torch.float64
DENSE_SIDE = int(win.DENSE_MAX_PAIRS**0.5)  # the default threshold, read before any test patches it


@pytest.fixture(autouse=True, params=["dense", "blocked"])
def path(request, monkeypatch):  # type: ignore[no-untyped-def]
    """The estimator's path for short inputs: dense (the default there) or blocked (forced)."""
    if request.param == "blocked":
        monkeypatch.setattr(win, "DENSE_MAX_PAIRS", 0)
    return request.param


def _fast(path: str, *xs: torch.Tensor, block: int = 4, **kw) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The function of ``path``: the dense form, or the blocked one with blocks of ``block``."""
    if path == "dense":
        return window_attention_dense(*xs, **kw)
    return window_attention_blocked(*xs, block_size=block, **kw)


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64) * scale


def _problem(n: int, m: int, d: int = 6, feats: int = 5, dv: int = 3, seed: int = 0, log_space: bool = True):
    q, k, v = _rand(2, 3, n, d, seed=seed), _rand(2, 3, m, d, seed=seed + 1), _rand(2, 3, m, dv, seed=seed + 2)
    pq, pk = _rand(2, 3, n, feats, seed=seed + 3, scale=2.0), _rand(2, 3, m, feats, seed=seed + 4, scale=2.0)
    if not log_space:
        pq, pk = pq.exp(), pk.exp()
    return q, k, v, pq, pk


def _mask(m: int) -> torch.Tensor:
    mask = torch.zeros(2, m, dtype=torch.bool)
    mask[0, m // 2 :] = True
    mask[1, :1] = True
    return mask


@pytest.mark.parametrize(
    ("n", "window", "glob", "causal", "log_space", "padded"),
    list(itertools.product([1, 7, 29], [0, 2, 5], [0, 2], [False, True], [True, False], [False, True])),
)
def test_fast_paths_match_naive(path, n, window, glob, causal, log_space, padded):
    q, k, v, pq, pk = _problem(n, n, log_space=log_space)
    mask = _mask(n) if padded else None
    kw = dict(log_space=log_space, window=window, global_tokens=glob, causal=causal, key_padding_mask=mask)
    ref = window_attention_naive(q, k, v, pq, pk, **kw)
    for block in sorted({max(window, 1), max(window, 4), 8}):  # the block length changes nothing
        out = _fast(path, q, k, v, pq, pk, block=block, **kw)
        torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "m"), [(5, 13), (13, 5), (20, 7)])
def test_cross_attention_matches_naive(path, n, m, causal):
    q, k, v, pq, pk = _problem(n, m)
    kw = dict(log_space=True, window=2, global_tokens=1, causal=causal, key_padding_mask=_mask(m))
    out = _fast(path, q, k, v, pq, pk, **kw)
    torch.testing.assert_close(out, window_attention_naive(q, k, v, pq, pk, **kw), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize(("causal", "log_space"), [(False, True), (True, True), (True, False), (False, False)])
def test_gradients_match_naive_and_gradcheck(path, causal, log_space):
    q, k, v, pq, pk = (t[:, :1] for t in _problem(10, 10, d=3, feats=3, dv=2, seed=5, log_space=log_space))
    inputs = [t.clone().requires_grad_() for t in (q, k, v, pq, pk)]
    kw = dict(log_space=log_space, window=2, global_tokens=1, causal=causal, key_padding_mask=_mask(10))

    def fast(*xs):
        return _fast(path, *xs, **kw)

    torch.autograd.gradcheck(fast, inputs)
    w = _rand(2, 1, 10, 2, seed=9)
    g_fast = torch.autograd.grad((fast(*inputs) * w).sum(), inputs)
    g_ref = torch.autograd.grad((window_attention_naive(*inputs, **kw) * w).sum(), inputs)
    for a, b in zip(g_fast, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_naive_reference_is_the_stated_formula():
    # a hand-built weight matrix, independent of both implementations
    q, k, v, pq, pk = _problem(6, 6, seed=3)
    out = window_attention_naive(
        q, k, v, pq, pk, log_space=True, window=1, global_tokens=1, causal=True, key_padding_mask=None
    )
    w = torch.zeros(2, 3, 6, 6, dtype=F64)
    for i in range(6):
        for j in range(i + 1):
            if i - j < 1 or j < 1:
                w[:, :, i, j] = (q[:, :, i] * k[:, :, j]).sum(-1).exp()
            else:
                w[:, :, i, j] = (pq[:, :, i].exp() * pk[:, :, j].exp()).sum(-1)
    torch.testing.assert_close(out, (w / w.sum(-1, keepdim=True)) @ v, rtol=1e-12, atol=1e-13)
    exact, seen = exact_sets(4, 4, 1, 0, False, torch.device("cpu"))
    assert exact.sum() == 4 + 2 * 3 and bool(seen.all())


def _est(window: int = 3, **options) -> SlidingWindowAttention:
    options.setdefault("num_features", 8)
    return ka.create("sliding-window", window=window, **options).double()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature_map", ["hedgehog", "elu", "prf"])
@torch.no_grad()
def test_window_covering_the_sequence_is_exact_softmax(causal, feature_map):
    q, k, v = _rand(2, 2, 37, 8, seed=1, scale=1.5), _rand(2, 2, 37, 8, seed=2, scale=1.5), _rand(2, 2, 37, 4, seed=3)
    ref = ka.create("softmax")(q, k, v, causal=causal)
    for window in (37, 100):
        out = _est(window, feature_map=feature_map)(q, k, v, causal=causal)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    # a window that does not cover the sequence is not exact: the check can fail
    assert float((_est(4, feature_map=feature_map)(q, k, v, causal=causal) - ref).abs().max()) > 1e-3


@pytest.mark.parametrize("causal", [False, True])
@torch.no_grad()
def test_rows_sum_to_one(causal):
    q, k = _rand(1, 2, 50, 8, seed=4, scale=2.0), _rand(1, 2, 50, 8, seed=5, scale=2.0)
    eye = torch.eye(50, dtype=F64).expand(1, 2, 50, 50)
    rows = _est(4, global_tokens=1)(q, k, eye, causal=causal)  # one-hot values: the weight rows
    torch.testing.assert_close(rows.sum(-1), torch.ones(1, 2, 50, dtype=F64), rtol=0, atol=1e-12)
    assert bool((rows >= 0).all())
    if causal:
        assert float(rows.triu(1).abs().max()) == 0.0


def test_estimator_matches_naive_through_the_map():
    from kernelattn_hybrid.naive import leading_padding

    est = _est(2, global_tokens=1, num_heads=3, activation="exp")
    q, k, v = _rand(2, 3, 21, 8, seed=6), _rand(2, 3, 21, 8, seed=7), _rand(2, 3, 21, 2, seed=8)
    mask = _mask(21)  # row 1 starts with a padded key: its global token is key 1
    for causal in (False, True):
        out = est(q, k, v, causal=causal, key_padding_mask=mask)
        qs, ks = q / 8**0.25, k / 8**0.25
        fm = est.feature_map
        ref = window_attention_naive(
            qs,
            ks,
            v,
            fm.query_log(qs),
            fm.key_log(ks),
            log_space=True,
            window=2,
            global_tokens=1,
            causal=causal,
            key_padding_mask=mask,
            global_offset=leading_padding(mask),
        )
        torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-12)


def test_padding_never_reaches_an_output():
    est = _est(3, global_tokens=2)
    q, k, v = _rand(2, 2, 19, 8, seed=10), _rand(2, 2, 19, 8, seed=11), _rand(2, 2, 19, 3, seed=12)
    mask = torch.zeros(2, 19, dtype=torch.bool)
    mask[0, 12:] = True
    mask[1, 1] = True  # a padded global token
    out = est(q, k, v, key_padding_mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 12:], v2[0, :, 12:] = float("nan"), float("inf")
    k2[1, :, 1], v2[1, :, 1] = 1e6, float("nan")
    torch.testing.assert_close(est(q, k2, v2, key_padding_mask=mask), out, rtol=0, atol=0)
    # the mask matters: the same perturbation without it changes outputs
    assert not torch.isfinite(est(q, k2, v2)).all()


def test_future_values_never_reach_an_output_even_nan():
    est = _est(3, global_tokens=1)
    q, k, v = _rand(1, 2, 40, 8, seed=13), _rand(1, 2, 40, 8, seed=14), _rand(1, 2, 40, 3, seed=15)
    full = est(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30], v2[:, :, 33] = float("nan"), float("nan")
    out = est(q, k2, v2, causal=True)
    torch.testing.assert_close(out[:, :, :30], full[:, :, :30], rtol=0, atol=0)
    assert bool(out[:, :, 30:].isnan().all())  # a visible NaN key poisons, as in exact attention


def test_causal_prefix_invariance_under_a_huge_later_key():
    est = _est(4, global_tokens=1)
    q, k, v = _rand(1, 2, 70, 8, seed=16), _rand(1, 2, 70, 8, seed=17), _rand(1, 2, 70, 3, seed=18)
    k_big = k.clone()
    k_big[:, :, 60] = 40.0  # enormous logits and log-features at a later position
    full = est(q, k_big, v, causal=True)
    assert bool(torch.isfinite(full).all())
    for cut in (1, 5, 33, 60):
        part = est(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], causal=True)
        torch.testing.assert_close(full[:, :, :cut], part, rtol=1e-12, atol=1e-13)


@torch.no_grad()
def test_half_precision_and_float32():
    est = _est(4).float()
    q, k, v = (_rand(1, 2, 64, 8, seed=s).float() for s in (19, 20, 21))
    ref = est(q, k, v)
    for dtype in (torch.float16, torch.bfloat16):
        out = est(q.to(dtype), k.to(dtype), v.to(dtype))
        assert out.dtype == dtype
        assert float((out.float() - ref).norm() / ref.norm()) < 3e-2


def test_budget_accounting_and_options():
    est = ka.create("sliding-window", window=16, num_features=64, global_tokens=1, num_heads=12, head_dim=32)
    assert est.exact_keys() == 34 and est.budget() == 98 and est.budget(causal=True) == 81
    assert est.feature_map.num_heads == 12 and est.feature_map.built
    # num_heads is offered only to maps that take it; the rest ignore it
    prf = ka.create("sliding-window", window=4, feature_map="prf", num_features=16, num_heads=12)
    assert prf.feature_map.name == "prf" and prf.num_features == 16
    soft = ka.create("sliding-window", num_features=8, activation="softmax")
    assert soft.feature_map.activation == "softmax"


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"window": -1}, "window"),
        ({"window": 1.5}, "window"),
        ({"global_tokens": -2}, "global_tokens"),
        ({"window": 8, "block_size": 4}, "block_size"),
        ({"feature_map": "no-such-map"}, "no-such-map"),
        ({"feature_map": 3}, "feature_map"),
        ({"num_features": 7}, "num_features"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_options_are_named(options, needle):
    with pytest.raises(Exception) as info:
        ka.create("sliding-window", **options)
    assert needle in str(info.value)


def test_per_head_map_refuses_another_head_count():
    est = _est(2, num_heads=4)
    q = _rand(1, 3, 10, 8, seed=22)
    with pytest.raises(InputError, match="num_heads = 4"):
        est(q, q, q)


@pytest.mark.parametrize("causal", [False, True])
def test_memory_is_linear_in_sequence_length(causal):
    # the largest tensor autograd saves grows like N, not N^2 (no [N, N] tensor)
    biggest = {}
    for n in (256, 1024):
        sizes: list[int] = []

        def pack(t: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        q, k, v = (_rand(1, 1, n, 8, seed=s).requires_grad_() for s in (23, 24, 25))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _est(8, num_features=16)(q, k, v, causal=causal)
        biggest[n] = max(sizes)
    assert biggest[1024] <= 4.5 * biggest[256], biggest


def test_short_inputs_take_the_dense_path_and_long_ones_the_blocked_one(path):
    est = _est(3, num_features=8)
    side = DENSE_SIDE
    for n, m, want in ((side, side, path), (side + 1, side, "blocked"), (1, side * side + 1, "blocked")):
        q, v = _rand(1, 1, n, 8, seed=40), _rand(1, 1, m, 2, seed=41)
        est(q, _rand(1, 1, m, 8, seed=42), v)
        assert est.last_backend == want, (n, m)
    # an explicit block length asks for the blocked computation at every length
    blocked = _est(3, num_features=8, block_size=4)
    blocked(_rand(1, 1, 5, 8, seed=40), _rand(1, 1, 5, 8, seed=42), _rand(1, 1, 5, 2, seed=41))
    assert blocked.last_backend == "blocked"


def test_dense_path_at_the_threshold_matches_the_blocked_one_with_gradients(monkeypatch):
    # the largest input the estimator sends to the dense path, a trained-size spread of the
    # logits: in float64 the two paths agree to rounding; in float32 (training) the dense
    # path is as close to float64 as the blocked one (error relative to each tensor's largest
    # entry; both measured ~2e-6 on the gradients)
    est = _est(16, num_features=16)
    q, k, v = (_rand(2, 2, DENSE_SIDE, 8, seed=s, scale=3.0) for s in (43, 44, 45))
    mask = torch.zeros(2, DENSE_SIDE, dtype=torch.bool)
    mask[1, DENSE_SIDE // 3 :] = True
    got = {}
    for dtype in (torch.float32, F64):
        for name, limit in (("dense", DENSE_SIDE**2), ("blocked", 0)):
            monkeypatch.setattr(win, "DENSE_MAX_PAIRS", limit)
            for causal in (False, True):
                xs = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
                out = est.to(dtype)(*xs, causal=causal, key_padding_mask=None if causal else mask)
                assert est.last_backend == name
                out.square().sum().backward()
                got[dtype, name, causal] = [out.detach().double()] + [x.grad.double() for x in xs]
    for causal in (False, True):
        ref = got[F64, "blocked", causal]
        for a, b in zip(got[F64, "dense", causal], ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)
        for a, b in zip(got[torch.float32, "dense", causal], ref, strict=True):
            assert float((a - b).abs().max() / b.abs().max()) < 2e-5


# ---------------------------------------------------------------- rows of the weight matrix (fitting)


@pytest.mark.parametrize(
    ("window", "glob", "causal", "log_space", "padded"),
    list(itertools.product([0, 3], [0, 2], [False, True], [True, False], [False, True])),
)
def test_rows_weights_are_the_naive_weight_matrix(window, glob, causal, log_space, padded):
    from kernelattn_hybrid.window import window_weights_rows

    n = 17
    q, k, _, pq, pk = _problem(n, n, log_space=log_space)
    mask = _mask(n) if padded else None
    kw = dict(log_space=log_space, window=window, global_tokens=glob, causal=causal, key_padding_mask=mask)
    eye = torch.eye(n, dtype=F64).expand(2, 3, n, n)
    full = window_attention_naive(q, k, eye, pq, pk, **kw)  # one-hot values: the weight matrix
    rows = torch.tensor([0, 4, 5, 16])
    got = window_weights_rows(q[:, :, rows], k, pq[:, :, rows], pk, rows, **kw)
    torch.testing.assert_close(got, full[:, :, rows], rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("causal", [False, True])
def test_estimator_attention_rows_match_one_hot_values_with_gradients(path, causal):
    n = 40
    q, k = _rand(1, 2, n, 8, seed=5, scale=1.5), _rand(1, 2, n, 8, seed=6, scale=1.5)
    est = ka.create("sliding-window", window=3, num_features=6, num_heads=2, global_tokens=1).double()
    rows = torch.tensor([1, 7, 20, 39])
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, 30:] = True
    got = est.attention_rows(q, k, rows, causal=causal, key_padding_mask=mask)
    eye = torch.eye(n, dtype=F64).expand(1, 2, n, n)
    ref = est(q, k, eye, causal=causal, key_padding_mask=mask)[:, :, rows]
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    # the fit's gradients (hedgehog's weights) agree with those through the forward path
    g_rows = torch.autograd.grad(got.square().sum(), list(est.parameters()))
    g_ref = torch.autograd.grad(ref.square().sum(), list(est.parameters()))
    for a, b in zip(g_rows, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert est.last_backend == path  # the reference call ran last; the rows call did not use it


def test_attention_rows_default_is_one_hot_values_and_validates():
    n = 9
    q, k = _rand(1, 2, n, 4, seed=7), _rand(1, 2, n, 4, seed=8)
    est = ka.create("softmax")
    rows = torch.tensor([2, 8])
    ref = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1)[:, :, rows]
    torch.testing.assert_close(est.attention_rows(q, k, rows), ref)
    with pytest.raises(InputError, match="rows"):
        est.attention_rows(q, k, torch.tensor([9]))
    with pytest.raises(InputError, match="rows"):
        est.attention_rows(q, k, torch.tensor([0.5]))


@pytest.mark.parametrize("nb", [1, 2, 3, 4, 10, 17])
def test_causal_feature_part_across_many_blocks_with_a_jump_of_300(path, nb):
    """The causal feature part (the engine's causal recurrence over the keys delayed by the
    window) against the quadratic reference, outputs and gradients, over ``nb`` blocks of 4
    with a jump of 300 in the key log-features halfway (the stabiliser moves by 300)."""
    n = 4 * nb
    q, k, v, pq, pk = (t[:, :2] for t in _problem(n, n, d=3, feats=3, dv=2, seed=nb))
    pk = pk.clone()
    pk[0, 0, n // 2 :] += 300.0
    pq, pk = pq.requires_grad_(), pk.requires_grad_()
    q, k, v = q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    kw = {"log_space": True, "window": 3, "global_tokens": 1, "causal": True, "key_padding_mask": None}
    out = _fast(path, q, k, v, pq, pk, **kw)
    ref = window_attention_naive(q, k, v, pq, pk, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-12)
    w = _rand(*out.shape, seed=nb + 7)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v, pq, pk))
    for a, b in zip(grads, torch.autograd.grad((ref * w).sum(), (q, k, v, pq, pk)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _opposed(n: int, d: int, norm: float, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """``q_i = -k_i`` of scaled norm ``norm`` (raw norm ``norm * d**0.25``): every logit on
    the diagonal is ``-norm**2``, while the log-features of ``q`` and ``k`` reach ``+norm``."""
    u = _rand(1, 2, n, d, seed=seed)
    u = u / u.norm(dim=-1, keepdim=True) * norm * d**0.25
    return u.to(dtype), (-u).to(dtype), _rand(1, 2, n, 3, seed=seed + 1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_single_key_at_norm_ten_gives_its_value_and_zero_logit_gradients(dtype, causal):
    # Issue #15: with one key, out = v whatever q and k are, so q.grad = k.grad = 0. The old
    # single stabiliser max(logit, a + c) put the exact term at e^{-100 - 11} (a + c only
    # bounds feature scores, and this row has none): a zero or subnormal denominator in
    # float32, then a zero row or a NaN q.grad.
    q, k, v = (t.requires_grad_() for t in _opposed(1, 3, 10.0, dtype, seed=30))
    est = ka.create("sliding-window", num_features=16).eval()
    out = est(q, k, v, causal=causal)
    torch.testing.assert_close(out, v.detach(), rtol=0, atol=0)
    out.float().square().sum().backward()
    for name, grad in (("q", q.grad), ("k", k.grad)):  # zero up to float32 rounding
        assert bool(torch.isfinite(grad).all()) and float(grad.abs().max()) < 1e-5, name
    torch.testing.assert_close(v.grad.float(), 2 * v.detach().float(), rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [16, 2])
def test_float32_at_norm_ten_matches_float64_with_gradients(path, causal, window):
    # exact and feature parts far apart in scale (diagonal logits -100, feature bounds +20):
    # float32 outputs and gradients must agree with the same estimator in float64
    n = 23
    q, k, v = _opposed(n, 3, 10.0, F64, seed=31)
    block = max(window, 4) if path == "blocked" else None  # None: the dense path at this length
    est = ka.create("sliding-window", window=window, num_features=16, block_size=block).eval()
    grads = {}
    for dtype in (torch.float32, F64):
        xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = est.to(dtype)(*xs, causal=causal)
        (out * _rand(*out.shape, seed=32).to(dtype)).sum().backward()
        grads[dtype] = [out.detach()] + [x.grad for x in xs]
        assert est.last_backend == path
    for name, a, b in zip(("out", "q.grad", "k.grad", "v.grad"), grads[torch.float32], grads[F64], strict=True):
        assert bool(torch.isfinite(a).all()), name
        torch.testing.assert_close(a.double(), b, rtol=2e-3, atol=2e-4, msg=name)


@pytest.mark.parametrize("window", [16, 2])
def test_float32_without_autograd_at_norm_ten_matches_float64(monkeypatch, window):
    """Without autograd the blocked kernel clamps exp's arguments (local logits at e^-29 of
    the row's largest exact term, features at the smallest normal number): at norm ten the
    exact terms lie some 120 nats below the feature scale, and the float32 rows still
    agree with float64 (as under autograd, test above). Also the rows whose window holds no
    valid key (the second half padded in batch 0): their exact part is dropped, not read
    from the clamped terms."""
    monkeypatch.setattr(win, "DENSE_MAX_PAIRS", 0)
    n = 60
    q, k, v = _opposed(n, 3, 10.0, F64, seed=33)
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, n // 2 :] = True
    est = ka.create("sliding-window", window=window, num_features=16, block_size=max(window, 4)).eval()
    outs = {}
    for dtype in (torch.float32, F64):
        with torch.no_grad():
            outs[dtype] = est.to(dtype)(*(t.to(dtype) for t in (q, k, v)), key_padding_mask=mask).double()
    assert bool(torch.isfinite(outs[torch.float32]).all())
    torch.testing.assert_close(outs[torch.float32], outs[F64], rtol=2e-3, atol=2e-4)
    with torch.enable_grad():  # the float64 rows without autograd are those with it
        ref = est.to(F64)(*(t.clone().requires_grad_() for t in (q, k, v)), key_padding_mask=mask)
    torch.testing.assert_close(outs[F64], ref.detach(), rtol=1e-10, atol=1e-12)


def test_rows_without_an_exact_key_ignore_the_clamped_exact_terms_without_autograd():
    """Keys 10..19 padded: rows 12..17 have no valid key in their window (w = 2) and see only
    far keys, through features whose scale is e^-600. Without autograd the clamped exact
    terms of such a row (e^-236 in float64, at the stand-in maximum 0) must not count: the
    rows equal the naive result (counted, they would be the mean of the row's local values
    outside its window: the test fails when the kernel counts them)."""
    n = 40
    q, k, v, pq, pk = (t[:1, :1] for t in _problem(n, n, seed=51))
    pq, pk = pq - 300.0, pk - 300.0
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, 10:20] = True
    kw = dict(log_space=True, window=2, global_tokens=0, causal=False, key_padding_mask=mask)
    ref = window_attention_naive(q, k, v, pq, pk, **kw)
    with torch.no_grad():
        out = window_attention_blocked(q, k, v, pq, pk, block_size=4, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("far", ["product", "groups"])
@pytest.mark.parametrize("padded", [False, True])
def test_noncausal_far_sums_agree_with_naive(monkeypatch, padded, far):
    """Up to FAR_MATMUL_BLOCKS blocks the far sums are one [nb, nb] product, beyond in groups
    of FAR_GROUP blocks: with groups of 3, 4 and 16 (the default), blocks of 3 and 5
    positions (14 and 8 blocks: partial last groups), the blocked kernel is the naive
    result, outputs and gradients, either way."""
    monkeypatch.setattr(win, "FAR_MATMUL_BLOCKS", 64 if far == "product" else 0)
    q, k, v, pq, pk = (t[:, :1].clone().requires_grad_() for t in _problem(40, 40, seed=11))
    kw = dict(log_space=True, window=3, global_tokens=1, causal=False, key_padding_mask=_mask(40) if padded else None)
    ref = window_attention_naive(q, k, v, pq, pk, **kw)
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v, pq, pk))
    for group in (3, 4, 16):
        monkeypatch.setattr(win, "FAR_GROUP", group)
        for block in (3, 5):
            out = window_attention_blocked(q, k, v, pq, pk, block_size=block, **kw)
            torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-12)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v, pq, pk))
            for a, b in zip(grads, g_ref):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("log_space", [True, False])
@pytest.mark.parametrize(("glob", "padded"), [(0, False), (2, True)])
def test_noncausal_chunks_without_autograd_equal_one_pass(monkeypatch, log_space, glob, padded):
    """Without autograd the local part runs over chunks of blocks (CHUNK_BYTES); with it, in
    one pass. Chunks of 1, 2 and 5 blocks (which cut sequences and heads apart) give the
    one-pass output and the naive result."""
    n = 37
    q, k, v, pq, pk = _problem(n, n, seed=17, log_space=log_space)
    mask = _mask(n) if padded else None
    kw = dict(log_space=log_space, window=3, global_tokens=glob, causal=False, key_padding_mask=mask)
    xs = [t.clone().requires_grad_() for t in (q, k, v, pq, pk)]
    one_pass = window_attention_blocked(*xs, block_size=4, **kw).detach()
    ref = window_attention_naive(q, k, v, pq, pk, **kw)
    torch.testing.assert_close(one_pass, ref, rtol=1e-11, atol=1e-12)
    per_block = 4 * 12 * 8 * 3  # bytes of the three [C, 3C] float64 temporaries of one block
    for blocks in (1, 2, 5):
        monkeypatch.setattr(win, "CHUNK_BYTES", blocks * per_block)
        with torch.no_grad():
            out = window_attention_blocked(q, k, v, pq, pk, block_size=4, **kw)
        torch.testing.assert_close(out, one_pass, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("log_space", [True, False])
def test_noncausal_features_as_a_function_equal_features_as_tensors(log_space):
    """The non-causal kernel computes features given as a function on its padded copies of q
    and k and then works on them in place: the same output as precomputed features, with
    and without autograd, also for a function that returns (a view of) its input, which
    must not be overwritten (the kernel copies such a result first)."""
    n = 30
    q, k, v, _, _ = _problem(n, n, d=5, seed=23)
    w = _rand(5, 5, seed=24)

    def linear(x: torch.Tensor, query: bool) -> torch.Tensor:  # a fresh tensor
        return x @ w if log_space else (x @ w).exp()

    def itself(x: torch.Tensor, query: bool) -> torch.Tensor:  # the kernel's own copy, returned
        return x if log_space else x.view(x.shape)

    kw = dict(log_space=log_space, window=3, global_tokens=2, causal=False, key_padding_mask=_mask(n), block_size=4)
    for fn in (linear, itself):
        ref = window_attention_blocked(q, k, v, fn(q, True), fn(k, False), **kw)
        with torch.no_grad():
            out = window_attention_blocked(q, k, v, fn, fn, **kw)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = window_attention_blocked(*xs, fn, fn, **kw)
        torch.testing.assert_close(out.detach(), ref, rtol=1e-12, atol=1e-13)
        grads = torch.autograd.grad(out.square().sum(), xs)
        ys = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_g = torch.autograd.grad(
            window_attention_blocked(*ys, fn(ys[0], True), fn(ys[1], False), **kw).square().sum(), ys
        )
        for a, b in zip(grads, ref_g, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("padded", [False, True])
def test_estimator_without_autograd_equals_with_it(padded):
    """The estimator's blocked non-causal path without autograd (features on the padded
    copies, in-place steps, chunks) gives its output under autograd."""
    n = 200  # past DENSE_MAX_PAIRS: the blocked path
    q, k, v = (_rand(2, 3, n, 8, seed=s) for s in (40, 41, 42))
    mask = torch.zeros(2, n, dtype=torch.bool)
    if padded:
        mask[0, 150:] = True
    est = ka.create("sliding-window", window=6, num_features=10, num_heads=3, head_dim=8, global_tokens=1, seed=0)
    est = est.double().eval()
    ref = est(q, k, v, key_padding_mask=mask)
    assert ref.requires_grad and est.last_backend == "blocked"
    with torch.no_grad():
        out = est(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("group", [None, 3, 4, 16])  # None: the [nb, nb] product
@pytest.mark.parametrize("nb", [3, 7, 16, 17, 50])
def test_far_sums_are_sums_of_the_far_blocks_even_beside_a_huge_one(monkeypatch, group, nb):
    """Far sums (the product, and in groups) against the brute-force sum over the blocks two
    or more away, with block 1 1e12 times larger than the others: no far sum is a
    difference, so the small ones stay exact in float32 (negative control: total minus the
    near blocks, as a difference, loses them)."""
    monkeypatch.setattr(win, "FAR_MATMUL_BLOCKS", 1024 if group is None else 0)
    if group is not None:
        monkeypatch.setattr(win, "FAR_GROUP", group)
    s_blk = torch.rand(2, nb, 2, 3, generator=torch.Generator().manual_seed(nb)) + 0.5  # float32
    s_blk[:, 1] *= 1e12
    far = win._far_sums(s_blk)
    brute = torch.stack([s_blk[:, [j for j in range(nb) if abs(j - b) >= 2]].double().sum(1) for b in range(nb)], 1)
    torch.testing.assert_close(far.double(), brute, rtol=1e-6, atol=0)
    if nb >= 5:  # block 3 sees block 0 and blocks 5.. only, all small
        near = s_blk.sum(1) - s_blk[:, 2:5].sum(1)  # total minus blocks 2..4 still holds block 1's 1e12
        diff = near - s_blk[:, 1]
        rel = ((diff.double() - brute[:, 3]).abs() / brute[:, 3]).max()
        assert float(rel) > 0.05


# ---------------------------------------------------------------------- decoding state
def _decode(est, q, k, v, mask, first: int, middle: int = 0):
    """``first`` positions in one call, then ``middle`` in a second call, then one at a time."""
    cut = [0, first, first + middle] if middle else [0, first]
    outs, state = [], None
    bounds = [*itertools.pairwise(cut), *((t, t + 1) for t in range(cut[-1], q.shape[2]))]
    for a, b in bounds:
        one = None if mask is None else mask[:, a:b]
        out, state = est.step(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], state, key_padding_mask=one)
        outs.append(out)
    return torch.cat(outs, dim=2), state


@pytest.mark.parametrize(
    ("window", "glob", "fmap", "padded", "first"),
    [
        (w, g, fmap, padded, 1 + 5 * ((w + g) % 2))  # the first call takes one or six positions
        for w, g, fmap, padded in itertools.product([0, 1, 3, 8], [0, 2], ["hedgehog", "elu"], [False, True])
    ]
    + [(3, 1, "prf", True, 6), (0, 0, "prf", False, 1)],
)
def test_step_by_step_equals_the_causal_forward(window, glob, fmap, padded, first):
    """The constant-size state (ring buffer of the last w keys, the global tokens, the
    feature sums of every position that left the window) gives the causal forward's rows."""
    est = ka.create("sliding-window", window=window, global_tokens=glob, feature_map=fmap, num_features=8, seed=0)
    est = est.double().eval()
    q, k, v = (
        _rand(2, 3, 23, 4, seed=40, scale=1.5),
        _rand(2, 3, 23, 4, seed=41, scale=1.5),
        _rand(2, 3, 23, 5, seed=42),
    )
    mask = None
    if padded:
        mask = torch.zeros(2, 23, dtype=torch.bool)
        mask[0, :4] = True  # left padding
        mask[1, 10:13] = True
    full = est(q, k, v, causal=True, key_padding_mask=mask)
    got, state = _decode(est, q, k, v, mask, first)
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-12)
    assert state.length == 23 and state.keys.shape == (2, 3, window, 4) and state.sink_keys.shape[2] == glob


def test_step_continues_several_positions_at_once():
    est = ka.create("sliding-window", window=3, global_tokens=1, num_features=8).double().eval()
    q, k, v = _rand(2, 2, 15, 4, seed=43), _rand(2, 2, 15, 4, seed=44), _rand(2, 2, 15, 3, seed=45)
    full = est(q, k, v, causal=True)
    got, _ = _decode(est, q, k, v, None, first=4, middle=6)
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("window", "glob"), [(3, 1), (0, 0), (5, 0)])
def test_step_poisons_the_rows_the_forward_poisons(window, glob):
    """A NaN key poisons its own and every later row; an inf query its own row; a NaN value
    at a padded position nothing (the forward's rule, token by token)."""
    est = ka.create("sliding-window", window=window, global_tokens=glob, num_features=8, head_dim=4)
    est = est.double().eval()
    q, k, v = _rand(2, 3, 17, 4, seed=46), _rand(2, 3, 17, 4, seed=47), _rand(2, 3, 17, 5, seed=48)
    k[0, 1, 6] = float("nan")
    q[1, 2, 9] = float("inf")
    v[1, 0, 12, 2] = float("nan")
    mask = torch.zeros(2, 17, dtype=torch.bool)
    mask[1, 12] = True
    full = est(q, k, v, causal=True, key_padding_mask=mask)
    got, _ = _decode(est, q, k, v, mask, first=4, middle=6)
    assert torch.equal(got.isnan(), full.isnan()) and int(full.isnan().any(-1).sum()) == 12
    keep = ~full.isnan()
    torch.testing.assert_close(got[keep], full[keep], rtol=1e-10, atol=1e-12)


def test_state_size_does_not_grow_with_the_context():
    est = ka.create("sliding-window", window=4, global_tokens=1, num_features=8).eval()
    x = _rand(1, 2, 200, 4, seed=49).float()
    _, state = est.step(x[:, :, :1], x[:, :, :1], x[:, :, :1])
    sizes = []
    for t in range(1, 200):
        _, state = est.step(x[:, :, t : t + 1], x[:, :, t : t + 1], x[:, :, t : t + 1], state)
        if t in (10, 199):
            sizes.append(sum(f.numel() for f in (state.keys, state.values, state.features.kv, state.features.z)))
    assert sizes[0] == sizes[1] == 2 * (4 * 4 + 4 * 4 + 8 * 4 + 8)


def test_step_refuses_another_windows_state():
    a = ka.create("sliding-window", window=4, num_features=8)
    b = ka.create("sliding-window", window=5, num_features=8)
    x = _rand(1, 2, 3, 4, seed=50).float()
    _, state = a.step(x, x, x)
    with pytest.raises(InputError, match="state: expected the state of SlidingWindowAttention\\(window=5"):
        b.step(x, x, x, state)


@pytest.mark.parametrize("keep_kind", ["bool", "float", "none"])
def test_the_recorded_masked_exp_equals_exp_after_masking_with_minus_inf(keep_kind: str) -> None:
    """:func:`~kernelattn_hybrid.window._exp_masked` under autograd (clamped, no clamp
    backward) gives the outputs and gradients of ``masked_fill(-inf).exp()`` bit for bit
    on stabilised arguments, exactly 0 where masked (a NaN there included, in the output
    and the gradient), and second derivatives by gradgradcheck."""
    from kernelattn_hybrid.window import _exp_masked

    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 2, 24, 24, generator=g, dtype=torch.float64)
    base = base - base.amax(-1, keepdim=True)  # <= 0, as the callers' stabilised arguments
    i = torch.arange(24)
    band = ((i[:, None] - i[None, :]) >= 0) & ((i[:, None] - i[None, :]) < 5)
    keep = {"bool": band, "float": band.double(), "none": None}[keep_kind]
    if keep is not None:
        base[..., ~band] = float("nan")  # a masked value never reaches the result
    weight = torch.randn(base.shape, generator=g, dtype=torch.float64)

    def run(fn):  # type: ignore[no-untyped-def]
        leaf = base.clone().requires_grad_(True)
        out = fn(leaf * 1.0)
        (out * weight).sum().backward()
        return out.detach(), leaf.grad

    def reference(x: torch.Tensor) -> torch.Tensor:
        return (x if keep is None else x.masked_fill(keep == 0, float("-inf"))).exp()

    out, grad = run(lambda x: _exp_masked(x, keep, recorded=True))
    ref_out, ref_grad = run(reference)
    assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad)
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    if keep is not None:
        assert (out[..., ~band] == 0).all() and (grad[..., ~band] == 0).all()
    small = (base[0, 0, :6, :6].nan_to_num(-3.0) - 0.5).requires_grad_(True)  # off the clamp's bound
    sub = None if keep is None else keep[:6, :6]
    assert torch.autograd.gradgradcheck(lambda x: _exp_masked(x * 1.0, sub, recorded=True), (small,))
