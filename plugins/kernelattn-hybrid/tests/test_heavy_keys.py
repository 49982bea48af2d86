"""sliding-window's heavy keys: the linear-time choice against the full feature matrix, the
dense and blocked forms against the quadratic reference (outputs and gradients), masks,
non-finite inputs, refusals and the budget."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernelattn_hybrid import window as win
from kernelattn_hybrid.heavy import HeavyKeys, estimated_key_mass, select_heavy_keys
from kernelattn_hybrid.naive import heavy_keys_naive, leading_padding, window_attention_naive
from kernelattn_hybrid.window import window_attention_blocked, window_attention_dense, window_weights_rows

import kernelattn_core as ka
from kernelattn_core.toolkit import InputError

F64 = torch.float64


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64) * scale


def _mask(m: int) -> torch.Tensor:
    """Row 0 padded at the end, row 1 padded at the start (left padding moves its globals)."""
    mask = torch.zeros(2, m, dtype=torch.bool)
    mask[0, m - m // 3 :] = True
    mask[1, :3] = True
    return mask


def _problem(n: int, m: int, seed: int = 0, log_space: bool = True, d: int = 6, feats: int = 5):
    q, k, v = _rand(2, 3, n, d, seed=seed), _rand(2, 3, m, d, seed=seed + 1), _rand(2, 3, m, 3, seed=seed + 2)
    pq, pk = _rand(2, 3, n, feats, seed=seed + 3, scale=1.5), _rand(2, 3, m, feats, seed=seed + 4, scale=1.5)
    if not log_space:
        pq, pk = pq.exp(), pk.exp()
    return q, k, v, pq, pk


def _brute_mass(pq, pk, log_space, key_valid=None, query_valid=None):  # type: ignore[no-untyped-def]
    """Column sums of the [N, M] feature attention, written out pair by pair."""
    b, h, n, _ = pq.shape
    m = pk.shape[-2]
    out = torch.zeros(b, h, m, dtype=F64)
    for bi, hi, i in itertools.product(range(b), range(h), range(n)):
        if query_valid is not None and not query_valid[bi, i]:
            continue
        f = pq[bi, hi, i]
        w = torch.stack([(f + pk[bi, hi, j]).exp().sum() if log_space else f @ pk[bi, hi, j] for j in range(m)])
        if key_valid is not None:
            w = w * key_valid[bi]
        out[bi, hi] += w / w.sum()
    return out


@pytest.mark.parametrize("log_space", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_estimated_mass_is_the_column_sum_of_feature_attention(log_space, masked):
    *_, pq, pk = _problem(9, 9, seed=1, log_space=log_space)
    key_valid = ~_mask(9) if masked else None
    mass = estimated_key_mass(pq, pk, log_space=log_space, key_valid=key_valid, query_valid=key_valid)
    torch.testing.assert_close(mass, _brute_mass(pq, pk, log_space, key_valid, key_valid), rtol=1e-12, atol=1e-12)
    # the masses of the queries counted add up to their number
    rows = 9 if key_valid is None else key_valid.sum(-1)[:, None].to(F64)
    torch.testing.assert_close(mass.sum(-1), torch.as_tensor(rows, dtype=F64).expand(2, 3), rtol=1e-12, atol=0)


def test_choice_is_the_top_of_the_full_matrix_and_marks_missing_places():
    *_, pq, pk = _problem(12, 12, seed=2)
    valid = ~_mask(12)
    eligible = torch.ones(2, 12, dtype=torch.bool)
    eligible[:, 0] = False
    fast = select_heavy_keys(pq, pk, 4, log_space=True, eligible=eligible, key_valid=valid, query_valid=valid)
    ref = heavy_keys_naive(pq, pk, 4, log_space=True, eligible=eligible, key_valid=valid, query_valid=valid)
    assert torch.equal(fast.mask(12), ref.mask(12))
    assert bool(fast.valid.all())
    assert not fast.mask(12)[:, :, 0].any()  # never an ineligible key
    assert not (fast.mask(12) & ~valid[:, None, :]).any()  # never a padded key
    # more places than eligible keys: the extra places are marked invalid, the mask stays right
    many = select_heavy_keys(pq, pk, 30, log_space=True, eligible=eligible, key_valid=valid, query_valid=valid)
    assert many.index.shape[-1] == 12
    torch.testing.assert_close(many.valid.sum(-1), (valid & eligible).sum(-1)[:, None].expand(2, 3))
    assert torch.equal(many.mask(12), (valid & eligible)[:, None, :].expand(2, 3, 12))


def test_heavy_keys_mask():
    hk = HeavyKeys(torch.tensor([[[3, 0, 5]]]), torch.tensor([[[True, False, True]]]))
    assert hk.mask(6).tolist() == [[[False, False, False, True, False, True]]]


@pytest.mark.parametrize(
    ("n", "window", "glob", "padded", "log_space", "count"),
    [
        (n, w, g, p, ls, s)
        for n, w, g, p, ls, s in itertools.product([7, 29], [0, 2, 5], [0, 2], [False, True], [True, False], [3])
    ]
    + [(29, 2, 1, True, True, 40), (29, 2, 1, False, True, 1)],
)
def test_fast_forms_match_naive_with_heavy_keys(n, window, glob, padded, log_space, count):
    q, k, v, pq, pk = _problem(n, n, seed=3, log_space=log_space)
    mask = _mask(n) if padded else None
    offset = None if mask is None else leading_padding(mask)
    valid = None if mask is None else ~mask
    o = torch.zeros(2, 1, dtype=torch.long) if offset is None else offset[:, None]
    pos = torch.arange(n)
    eligible = (pos < o) | (pos >= o + glob)  # the kernels' precondition: no global token is heavy
    heavy = heavy_keys_naive(pq, pk, count, log_space=log_space, eligible=eligible, key_valid=valid, query_valid=valid)
    kw = dict(log_space=log_space, window=window, global_tokens=glob, causal=False, key_padding_mask=mask)
    kw["global_offset"] = offset
    ref = window_attention_naive(q, k, v, pq, pk, heavy=heavy, **kw)
    torch.testing.assert_close(window_attention_dense(q, k, v, pq, pk, heavy=heavy, **kw), ref, rtol=1e-11, atol=1e-12)
    for block in sorted({max(window, 1), max(window, 4), 8}):  # several blocks, far sums
        out = window_attention_blocked(q, k, v, pq, pk, block_size=block, heavy=heavy, **kw)
        torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-12)
    rows = torch.tensor([0, n // 2, n - 1])
    w = window_weights_rows(q[:, :, rows], k, pq[:, :, rows], pk, rows, heavy=heavy, **kw)
    torch.testing.assert_close(w @ v, ref[:, :, rows], rtol=1e-11, atol=1e-12)
    # the heavy keys change the result (a reference without them differs)
    assert (window_attention_naive(q, k, v, pq, pk, **kw) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("form", ["dense", "blocked"])
def test_gradients_with_heavy_keys_match_naive_and_gradcheck(form):
    q, k, v, pq, pk = (t[:, :1] for t in _problem(13, 13, seed=4, d=3, feats=3))
    mask = _mask(13)
    heavy = heavy_keys_naive(pq, pk, 3, log_space=True, key_valid=~mask, query_valid=~mask)
    kw = dict(
        log_space=True,
        window=1,
        global_tokens=1,
        causal=False,
        key_padding_mask=mask,
        global_offset=leading_padding(mask),
        heavy=heavy,
    )
    inputs = [t.clone().requires_grad_() for t in (q, k, v, pq, pk)]

    def fast(*xs):  # type: ignore[no-untyped-def]
        if form == "dense":
            return window_attention_dense(*xs, **kw)
        return window_attention_blocked(*xs, block_size=3, **kw)

    torch.autograd.gradcheck(fast, inputs)
    w = _rand(2, 1, 13, 3, seed=9)
    g_fast = torch.autograd.grad((fast(*inputs) * w).sum(), inputs)
    g_ref = torch.autograd.grad((window_attention_naive(*inputs, **kw) * w).sum(), inputs)
    for a, b in zip(g_fast, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_chunks_without_autograd_equal_one_pass_with_heavy_keys(monkeypatch):
    q, k, v, pq, pk = _problem(37, 37, seed=5)
    mask = _mask(37)
    heavy = heavy_keys_naive(pq, pk, 4, log_space=True, key_valid=~mask, query_valid=~mask)
    kw = dict(log_space=True, window=3, global_tokens=1, causal=False, key_padding_mask=mask, heavy=heavy)
    kw["global_offset"] = leading_padding(mask)
    xs = [t.clone().requires_grad_() for t in (q, k, v, pq, pk)]
    one_pass = window_attention_blocked(*xs, block_size=4, **kw).detach()
    monkeypatch.setattr(win, "CHUNK_BYTES", 4 * 12 * 8 * 3 * 2)
    with torch.no_grad():
        out = window_attention_blocked(q, k, v, pq, pk, block_size=4, **kw)
    torch.testing.assert_close(out, one_pass, rtol=1e-13, atol=1e-14)


def _est(**options):  # type: ignore[no-untyped-def]
    opts = {"window": 2, "num_features": 6, "global_tokens": 1, "heavy_keys": 3, "num_heads": 2, **options}
    return ka.create("sliding-window", **opts).double()


@pytest.mark.parametrize("block_size", [None, 4])
def test_estimator_equals_the_reference_it_declares(block_size):
    est = _est(block_size=block_size)
    q, k, v = _rand(2, 2, 30, 8, seed=6), _rand(2, 2, 30, 8, seed=7), _rand(2, 2, 30, 3, seed=8)
    mask = _mask(30)
    out = est(q, k, v, key_padding_mask=mask)
    assert est.last_backend == ("dense" if block_size is None else "blocked")
    root = est._input_root(8)
    qs, ks = q * root, k * root
    fm = est.feature_map
    pq, pk = fm.raw_features(qs, query=True), fm.raw_features(ks, query=False)
    offset = leading_padding(mask)
    pos = torch.arange(30)
    eligible = (pos < offset[:, None]) | (pos >= offset[:, None] + 1)
    heavy = heavy_keys_naive(pq, pk, 3, log_space=True, eligible=eligible, key_valid=~mask, query_valid=~mask)
    ref = window_attention_naive(
        qs,
        ks,
        v,
        pq,
        pk,
        log_space=True,
        window=2,
        global_tokens=1,
        causal=False,
        key_padding_mask=mask,
        global_offset=offset,
        heavy=heavy,
    )
    keep = ~mask[:, None, :, None]
    torch.testing.assert_close(out * keep, ref * keep, rtol=1e-11, atol=1e-12)


def test_every_key_heavy_is_exact_softmax():
    est = _est(window=0, global_tokens=0, heavy_keys=40)
    q, k, v = _rand(1, 2, 25, 8, seed=9), _rand(1, 2, 25, 8, seed=10), _rand(1, 2, 25, 3, seed=11)
    torch.testing.assert_close(est(q, k, v), ka.create("softmax")(q, k, v), rtol=1e-12, atol=1e-12)


def test_attention_rows_choose_the_keys_the_forward_chooses_with_gradients():
    est = _est(block_size=4)
    q = _rand(1, 2, 21, 8, seed=12).requires_grad_()
    k = _rand(1, 2, 21, 8, seed=13).requires_grad_()
    rows = torch.tensor([0, 5, 20])
    w = est.attention_rows(q, k, rows)
    eye = torch.eye(21, dtype=F64).expand(1, 2, 21, 21)
    ref = est(q, k, eye)[:, :, rows]
    torch.testing.assert_close(w, ref, rtol=1e-11, atol=1e-12)
    g = torch.autograd.grad((w * _rand(*w.shape, seed=14)).sum(), (q, k))
    g_ref = torch.autograd.grad((ref * _rand(*w.shape, seed=14)).sum(), (q, k))
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("block_size", [None, 4])
def test_padded_positions_never_reach_an_output(block_size):
    est = _est(block_size=block_size)
    q, k, v = _rand(2, 2, 19, 8, seed=15), _rand(2, 2, 19, 8, seed=16), _rand(2, 2, 19, 3, seed=17)
    mask = torch.zeros(2, 19, dtype=torch.bool)
    mask[0, 12:] = True
    mask[1, :2] = True
    out = est(q, k, v, key_padding_mask=mask)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2):  # padded queries (self-attention) count in no choice either
        t[0, :, 12:], t[1, :, :2] = 30.0, float("nan")
    v2[0, :, 12:], v2[1, :, :2] = float("inf"), float("nan")
    keep = ~mask[:, None, :, None]  # the padded rows themselves hold whatever their query gives
    got = est(q2, k2, v2, key_padding_mask=mask)
    torch.testing.assert_close(torch.where(keep, got, 0.0), torch.where(keep, out, 0.0), rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [None, 4])
def test_a_non_finite_query_spoils_its_own_row_whatever_it_holds(block_size):
    est = _est(block_size=block_size)
    q, k, v = _rand(1, 2, 20, 8, seed=18), _rand(1, 2, 20, 8, seed=19), _rand(1, 2, 20, 3, seed=20)
    outs = []
    for bad in (float("nan"), float("inf"), -float("inf")):
        q2 = q.clone()
        q2[0, :, 7] = bad
        outs.append(est(q2, k, v))
    assert bool(outs[0][:, :, 7].isnan().all())
    others = torch.cat([outs[0][:, :, :7], outs[0][:, :, 8:]], 2)
    assert bool(torch.isfinite(others).all())
    for o in outs[1:]:
        torch.testing.assert_close(torch.cat([o[:, :, :7], o[:, :, 8:]], 2), others, rtol=0, atol=0)


def test_causal_calls_and_decoding_are_refused_naming_heavy_keys():
    est = _est()
    q = _rand(1, 2, 6, 8, seed=21)
    with pytest.raises(InputError, match="heavy_keys=3 is non-causal only"):
        est(q, q, q, causal=True)
    with pytest.raises(InputError, match="heavy_keys"):
        est.attention_rows(q, q, torch.tensor([1]), causal=True)
    with pytest.raises(InputError, match="step: .*heavy_keys"):
        est.step(q, q, q)
    with pytest.raises(InputError, match="heavy_keys"):
        ka.create("sliding-window", heavy_keys=-1)


def test_budget_counts_the_heavy_keys_non_causally():
    est = _est(window=4, global_tokens=1, heavy_keys=7, num_features=10)
    assert est.exact_keys() == 2 * 4 + 1 + 1 + 7
    assert est.budget() == 2 * 4 + 1 + 1 + 7 + 10
    assert est.exact_keys(causal=True) == 4 + 1
    assert "heavy_keys=7" in repr(est)
