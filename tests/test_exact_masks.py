"""Exact attention: values at padded or future positions never reach an output
(NaN and inf included), on both paths; empty shapes; non-finite scales refused."""

from __future__ import annotations

import pytest
import torch

import kernelattn_core as ka

from .conftest import qkv

BAD = [float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("backend", ["sdpa", "naive"])
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("where", ["k", "v"])
def test_padded_non_finite_never_reaches_a_row(backend: str, bad: float, where: str) -> None:
    q, k, v = qkv(b=2, n=6, m=7, dtype=torch.float32)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[0, 5:] = True
    mask[1, 0] = True
    est = ka.ExactAttention("softmax", backend=backend)
    ref = est(q, k, v, key_padding_mask=mask)
    t = (k if where == "k" else v).clone()
    t[0, :, 5:] = bad
    t[1, :, 0] = bad
    out = est(q, t if where == "k" else k, t if where == "v" else v, key_padding_mask=mask)
    assert torch.isfinite(out).all(), f"{backend}: a padded {where} = {bad} reached an output"
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("backend", ["sdpa", "naive"])
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("where", ["k", "v"])
def test_causal_future_non_finite_never_reaches_earlier_rows(backend: str, bad: float, where: str) -> None:
    q, k, v = qkv(n=8, dtype=torch.float32)
    est = ka.ExactAttention("softmax", backend=backend)
    ref = est(q, k, v, causal=True)
    t = (k if where == "k" else v).clone()
    t[..., 5, :] = bad
    out = est(q, t if where == "k" else k, t if where == "v" else v, causal=True)
    torch.testing.assert_close(out[..., :5, :], ref[..., :5, :])
    if where == "v":  # rows that see the value do get a non-finite output
        assert not torch.isfinite(out[..., 5:, :]).all()


@pytest.mark.parametrize("kernel", ["gaussian", "inv", "exp"])
def test_non_log_kernels_future_nan_key_and_value(kernel: str) -> None:
    q, k, v = qkv(n=6, d=4, scale=0.3)
    est = ka.create(kernel)
    ref = est(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[..., 4, :] = float("nan")
    v2[..., 4, :] = float("inf")
    out = est(q, k2, v2, causal=True)
    torch.testing.assert_close(out[..., :4, :], ref[..., :4, :])


def test_future_key_out_of_domain_does_not_raise_for_earlier_pairs() -> None:
    """inv needs |<q, k>| < 1: a future key far out of range must not matter to rows that
    cannot see it, while the same key paired with its own query does raise."""
    q, k, v = qkv(n=5, d=4, scale=0.1)
    est = ka.create("inv", scale=1.0)
    ref = est(q, k, v, causal=True)
    k2 = k.clone()
    k2[..., 4, :] = 50.0
    q2 = q.clone()
    q2[..., 4, :] = 0.0  # <q_4, k_4> = 0: in range; <q_i, k_4> for i < 4 is out of range but future
    out = est(q2, k2, v, causal=True)
    torch.testing.assert_close(out[..., :4, :], ref[..., :4, :])
    with pytest.raises(ka.DomainError, match="inv"):
        est(q, k2, v, causal=False)


def test_sdpa_and_naive_agree_with_masks_outputs_and_gradients() -> None:
    q, k, v = qkv(b=2, n=6, d=4)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, 2:] = True
    for causal in (False, True):
        outs, grads = [], []
        for backend in ("sdpa", "naive"):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out = ka.ExactAttention(backend=backend)(qq, kk, vv, causal=causal, key_padding_mask=mask)
            out.square().sum().backward()
            outs.append(out)
            grads.append([qq.grad, kk.grad, vv.grad])
        torch.testing.assert_close(outs[0], outs[1])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("shape", [(0, 2, 5, 7), (2, 2, 0, 7), (2, 2, 5, 0), (2, 0, 5, 7)])
@pytest.mark.parametrize("name", ["softmax", "elu", "inv"])
def test_empty_shapes_give_empty_output_of_the_right_shape(shape: tuple[int, ...], name: str) -> None:
    b, h, n, m = shape
    q = torch.randn(b, h, n, 4, requires_grad=True)
    k = torch.randn(b, h, m, 4, requires_grad=True)
    v = torch.randn(b, h, m, 3, requires_grad=True)
    out = ka.create(name)(q, k, v)
    assert out.shape == (b, h, n, 3)
    assert out.dtype == v.dtype
    assert (out == 0).all()
    out.sum().backward()
    assert q.grad is not None and (q.grad == 0).all()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert ref.shape == out.shape


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 0.0, -1.0, True, "1"])
def test_non_finite_or_non_positive_scale_refused(scale: object) -> None:
    with pytest.raises(ka.InputError, match="scale: expected a positive finite number"):
        ka.create("softmax", scale=scale)
    with pytest.raises(ka.InputError, match="scale"):
        ka.create("elu", scale=scale)


def test_meta_device_gives_a_clear_error() -> None:
    q = torch.empty(1, 1, 3, 4, device="meta")
    with pytest.raises(ka.InputError, match="meta"):
        ka.create("softmax")(q, q, q)


@pytest.mark.parametrize("kernel", ["softmax", "gaussian", "inv", "spectral-gmm"])
@pytest.mark.parametrize("where", ["k", "v", "q"])
def test_rows_that_see_no_bad_value_keep_their_gradients(kernel: str, where: str) -> None:
    """A loss on the rows before a non-finite key, value (position 5) or query (row 5):
    every gradient (q, k, v at all positions but the bad one) is finite and equal to the
    clean input's. Before, the rows that see the value were NaN and sent 0 * NaN back
    through their own normaliser into every earlier row's gradients."""
    q, k, v = qkv(n=8, d=4, scale=0.3, dtype=torch.float64)
    est = ka.create(kernel) if kernel not in ("softmax",) else ka.ExactAttention("softmax")
    est = est.double()
    dirty = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    dirty[where][..., 5, :] = float("nan")
    clean = [t.clone().requires_grad_() for t in (q, k, v)]
    bad = [dirty[n].requires_grad_() for n in "qkv"]
    out_c, out_d = est(*clean, causal=True), est(*bad, causal=True)
    torch.testing.assert_close(out_d[..., :5, :], out_c[..., :5, :])
    assert bool(torch.isnan(out_d[..., 5, :]).all())  # the row that sees it is NaN
    g_c = torch.autograd.grad(out_c[..., :5, :].sum(), clean)
    g_d = torch.autograd.grad(out_d[..., :5, :].sum(), bad)
    keep = torch.ones(8, dtype=torch.bool)
    keep[5] = False
    for a, b in zip(g_d, g_c):
        assert bool(torch.isfinite(a[..., keep, :]).all())
        torch.testing.assert_close(a[..., keep, :], b[..., keep, :], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["softmax", "exact"])
def test_exact_takes_a_seed_and_ignores_it(name: str) -> None:
    """A loop that gives every estimator one seed reaches the reference too (it raised
    "kernel 'softmax' takes no options"); the seed is checked as the random estimators
    check theirs (any int: ``prf`` takes -1 too), and changes nothing."""
    q, k, v = qkv()
    out = ka.create(name, seed=0)(q, k, v, causal=True)
    torch.testing.assert_close(out, ka.create(name)(q, k, v, causal=True), rtol=0, atol=0)
    ka.create(name, seed=-1)
    ka.create("prf", seed=-1)
    for bad in (1.5, "1", True):
        for est in (name, "prf"):
            with pytest.raises(ka.InputError, match=r"seed: expected an int or None, got"):
                ka.create(est, seed=bad)


@pytest.mark.parametrize("kernel", ["polynomial", "matern", "spectral-prf"])
def test_a_row_whose_kernel_overflows_is_nan_and_sends_no_gradient_back(kernel: str) -> None:
    """A finite but huge future key (float32 1e30) overflows ``(1 + q.k)^p``, Matern's
    ``(1 + z) e^-z`` or the GMM-PRF kernel's log-sum-exp in the rows that see it: they are
    NaN, as rows that see a non-finite input are, and the backward of their normalisation
    (0 * inf) no longer reaches the earlier keys' gradients; Matern's masked pairs hold
    ``q - k = 0`` before ``g``; a log-kernel overflowing at a masked pair (``spectral-prf``:
    ``+inf`` there made the earlier queries' gradients NaN) has its key quarantined."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8) for _ in range(3))
    est = ka.create(kernel)
    grads = []
    for huge in (False, True):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        if huge:
            with torch.no_grad():
                kk[:, :, 4:] = 1e30
        out = ka.kernel_attention(qq, kk, vv, est, causal=True)
        out[:, :, :4].sum().backward()
        # positions before the huge key (the rows that see it may pass NaN to their own query)
        grads.append((out.detach(), qq.grad[:, :, :4], kk.grad[:, :, :4], vv.grad[:, :, :4]))
    (clean, *clean_grads), (dirty, *dirty_grads) = grads
    torch.testing.assert_close(dirty[:, :, :4], clean[:, :, :4])
    assert torch.isnan(dirty[:, :, 4:]).all()
    for a, b in zip(dirty_grads, clean_grads):
        torch.testing.assert_close(a, b)


def test_an_overflowing_query_poisons_its_own_row_only() -> None:
    """A finite but huge query (float32 1e30) overflows the GMM-PRF log-kernel in its own
    row, at keys it sees and keys it may not: its row is NaN and no key is quarantined,
    so every other row keeps its output and gradients (the key-side quarantine of
    ``quarantine_overflow`` blames a key only for a row that is otherwise sound)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8) for _ in range(3))
    est = ka.create("spectral-prf")
    runs = []
    for huge in (False, True):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        if huge:
            with torch.no_grad():
                qq[:, :, 2] = 1e30
        out = ka.kernel_attention(qq, kk, vv, est, causal=True)
        others = torch.cat([out[:, :, :2], out[:, :, 3:]], 2)
        others.sum().backward()
        runs.append((out.detach(), others.detach(), kk.grad, vv.grad))
    (_, clean, *clean_grads), (dirty, others, *dirty_grads) = runs
    assert torch.isnan(dirty[:, :, 2]).all()
    torch.testing.assert_close(others, clean)
    for a, b in zip(dirty_grads, clean_grads):
        torch.testing.assert_close(a, b)
