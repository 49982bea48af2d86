"""The attention engine: linear forms against quadratic references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernelattn_core as ka
from kernelattn_core.engine.naive import feature_attention_naive
from kernelattn_core.engine.torch_backend import feature_attention_torch

from .conftest import qkv


def _ratio(num, den):  # type: ignore[no-untyped-def]
    return num / den.unsqueeze(-1)


def _padding(b: int, m: int) -> torch.Tensor:
    mask = torch.zeros(b, m, dtype=torch.bool)
    mask[0, :3] = True  # leading padding
    mask[-1, -4:] = True  # trailing padding
    return mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("log_space", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_linear_form_equals_quadratic_form(causal: bool, log_space: bool, chunk: int) -> None:
    q, k, v = qkv(n=13, d=6)
    phi_q, phi_k = q.clone(), k * 2.0  # fixed "features": log-features or positive features
    if not log_space:
        phi_q, phi_k = phi_q.exp(), phi_k.exp()
    mask = _padding(2, 13)
    ref = _ratio(*feature_attention_naive(phi_q, phi_k, v, log_space=log_space, causal=causal, key_padding_mask=mask))
    got = _ratio(
        *feature_attention_torch(
            phi_q, phi_k, v, log_space=log_space, causal=causal, key_padding_mask=mask, chunk_size=chunk
        )
    )
    valid = torch.isfinite(ref)  # rows with no allowed key are 0/0 in the ratio
    assert valid.any()
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-10, atol=1e-10)


def test_signed_features_linear_equals_quadratic() -> None:
    q, k, v = qkv(n=11, d=4, seed=3)
    ref = feature_attention_naive(q, k, v, log_space=False, causal=True, key_padding_mask=None)
    got = feature_attention_torch(q, k, v, log_space=False, causal=True, key_padding_mask=None, chunk_size=3)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_equals_scaled_dot_product_attention(causal: bool) -> None:
    q, k, v = qkv(n=17, d=16, dv=7)
    out = ka.kernel_attention(q, k, v, ka.create("softmax"), causal=causal)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_softmax_with_padding_equals_sdpa_with_boolean_mask() -> None:
    q, k, v = qkv(n=9, m=12, d=8)
    mask = _padding(2, 12)
    out = ka.kernel_attention(q, k, v, ka.create("softmax"), key_padding_mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask[:, None, None, :])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["elu", "toy-prf", "toy-trig"])
def test_feature_map_attention_equals_exact_attention_with_its_own_estimate(use_registry, name: str) -> None:
    """Feature-map attention equals exact attention whose kernel is phi_q . phi_k."""
    q, k, v = qkv(n=10, d=8)
    est = ka.create(name, head_dim=8, seed=1)
    qs, ks = est.transform(q, k)
    kmat = est.feature_map.kernel_estimate(qs, ks)  # [B, H, N, M]
    for causal in (False, True):
        mask = _padding(2, 10)
        out = est(q, k, v, causal=causal, key_padding_mask=mask)
        allowed = torch.ones(10, 10, dtype=torch.bool).tril() if causal else torch.ones(10, 10, dtype=torch.bool)
        allowed = allowed[None, None] & ~mask[:, None, None, :]
        a = kmat.masked_fill(~allowed, 0)
        ref = (a @ v) / a.sum(-1, keepdim=True)
        rows = allowed.any(-1, keepdim=True).expand_as(ref)
        torch.testing.assert_close(out[rows], ref[rows], rtol=1e-9, atol=1e-10)


def test_cross_attention_shapes_and_value_width(use_registry) -> None:
    q, k, v = qkv(b=2, h=4, n=7, m=19, d=8, dv=3)
    for name in ("softmax", "elu", "toy-prf"):
        out = ka.create(name)(q, k, v)
        assert out.shape == (2, 4, 7, 3)
        assert out.dtype == torch.float64


@pytest.mark.parametrize("name", ["softmax", "elu", "toy-prf", "toy-trig"])
def test_padded_keys_leave_numerator_and_normaliser(use_registry, name: str) -> None:
    """Changing padded keys and values, or dropping them, leaves the output unchanged."""
    q, k, v = qkv(n=8, m=10, d=8, seed=5)
    est = ka.create(name, **({} if name == "softmax" else {"seed": 3}))
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, 6:] = True
    out = est(q, k, v, key_padding_mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 6:] = 50.0  # would dominate any normaliser that counted them
    v2[:, :, 6:] = 1e6
    torch.testing.assert_close(est(q, k2, v2, key_padding_mask=mask), out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(est(q, k[:, :, :6], v[:, :, :6]), out, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["softmax", "elu", "toy-prf"])
@pytest.mark.parametrize("causal", [False, True])
def test_query_with_all_keys_masked_gets_zeros(use_registry, name: str, causal: bool) -> None:
    q, k, v = qkv(n=6, d=8)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0] = True  # every key of batch 0 padded
    mask[1, :2] = True  # causal: the first two queries of batch 1 see no key
    out = ka.create(name)(q, k, v, causal=causal, key_padding_mask=mask)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all()
    if causal:
        assert (out[1, :, :2] == 0).all()
        assert (out[1, :, 2:] != 0).any()


@pytest.mark.parametrize("name", ["softmax", "elu", "toy-prf", "toy-trig"])
def test_prefix_invariance_appending_tokens_never_changes_earlier_outputs(use_registry, name: str) -> None:
    q, k, v = qkv(n=24, d=8, seed=7)
    est = ka.create(name)
    if hasattr(est, "chunk_size"):
        est.chunk_size = 8
    full = est(q, k, v, causal=True)
    for cut in (1, 5, 8, 13):
        part = est(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], causal=True)
        torch.testing.assert_close(full[:, :, :cut], part, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name", ["softmax", "toy-prf"])
def test_causal_stabiliser_does_not_leak_the_future(use_registry, name: str) -> None:
    """A huge later key would underflow earlier keys if the stabiliser took a maximum
    over the whole sequence; earlier outputs must stay bit-identical."""
    q, k, v = qkv(b=1, h=1, n=16, d=8, seed=2, dtype=torch.float32)
    est = ka.create(name, **({} if name == "softmax" else {"seed": 0, "chunk_size": 16}))
    before = est(q, k, v, causal=True)
    k2 = k.clone()
    k2[:, :, 12] = 40.0 * q[:, :, 12] / q[:, :, 12].norm()  # enormous logit for position 12 only
    after = est(q, k2, v, causal=True)
    assert torch.isfinite(after).all()
    assert torch.equal(before[:, :, :12], after[:, :, :12])
    assert not torch.equal(before[:, :, 12:], after[:, :, 12:])


def test_leaky_whole_sequence_stabiliser_is_caught() -> None:
    """Negative control: the prefix-invariance check catches a stabiliser that takes
    the maximum over the whole key sequence."""
    q, k, v = qkv(b=1, h=1, n=16, d=8, seed=2, dtype=torch.float32)
    lq, lk = q, k.clone()

    def leaky(lq: torch.Tensor, lk: torch.Tensor) -> torch.Tensor:
        fk = (lk - lk.amax()).exp()  # global maximum: depends on the future
        fq = (lq - lq.amax(-1, keepdim=True)).exp()
        num, den = feature_attention_naive(fq, fk, v, log_space=False, causal=True, key_padding_mask=None)
        return num / den.unsqueeze(-1)

    lk2 = lk.clone()
    lk2[:, :, 12] = 200.0
    assert not torch.equal(leaky(lq, lk)[:, :, :12], leaky(lq, lk2)[:, :, :12])


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(use_registry, causal: bool) -> None:
    q, k, v = qkv(b=1, h=2, n=5, d=3, dv=2)
    mask = torch.zeros(1, 5, dtype=torch.bool)
    mask[0, 4] = True
    for name in ("softmax", "elu", "toy-prf"):
        est = ka.create(name, **({} if name == "softmax" else {"chunk_size": 2}))
        inputs = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
        assert torch.autograd.gradcheck(
            lambda a, b, c, est=est: est(a, b, c, causal=causal, key_padding_mask=mask), inputs
        )


@pytest.mark.parametrize("causal", [False, True])
def test_torch_backend_gradients_match_naive_reference(causal: bool) -> None:
    q, k, v = qkv(n=12, d=5, seed=4)
    mask = _padding(2, 12)
    grads = []
    for fn in (feature_attention_naive, feature_attention_torch):
        a, b, c = (t.clone().requires_grad_(True) for t in (q, k, v))
        kwargs = {"chunk_size": 5} if fn is feature_attention_torch else {}
        num, den = fn(a, b, c, log_space=True, causal=causal, key_padding_mask=mask, **kwargs)
        out = ka.RowNormalizer().normalize(num, den)  # rows with no allowed key give 0, not 0/0
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        grads.append([t.grad for t in (a, b, c)])
    for g_fast, g_ref in zip(*grads):
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_long_sequence_stays_finite(use_registry, dtype: torch.dtype) -> None:
    """Key sums over a long sequence overflow float16 unless accumulated in float32."""
    q, k, v = qkv(b=1, h=1, n=4096, d=16, dv=4, dtype=torch.float32, seed=9)
    v = v * 100  # sum over 4096 keys of values ~100 exceeds the float16 range (65504)
    for name in ("elu", "toy-prf"):
        est = ka.create(name, seed=0)
        ref = est(q, k, v, causal=True)
        out = est(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
        assert out.dtype == dtype
        assert torch.isfinite(out).all()
        rel = (out.float() - ref).norm() / ref.norm()
        assert rel < 2e-2


def test_backend_is_reported_and_can_be_forced(use_registry) -> None:
    q, k, v = qkv()
    est = ka.create("toy-prf", backend="torch")
    est(q, k, v)
    assert est.last_backend == "torch"
    with pytest.raises(ka.InputError, match="backend: expected one of"):
        ka.create("toy-prf", backend="nope")(q, k, v)


def test_causal_memory_does_not_grow_with_n_d_dv() -> None:
    """The chunked causal form never holds an [N, D, dv] cumulative state: peak memory
    under no_grad grows linearly in N with a slope far below N*D*dv."""
    from kernelattn_core.cli.measure import peak_memory

    d_feat, dv = 64, 64

    def peak(n: int) -> int:
        g = torch.Generator().manual_seed(0)
        fq = torch.rand(1, 1, n, d_feat, generator=g)
        fk = torch.rand(1, 1, n, d_feat, generator=g)
        v = torch.randn(1, 1, n, dv, generator=g)
        with torch.no_grad():
            return peak_memory(
                lambda: feature_attention_torch(
                    fq, fk, v, log_space=False, causal=True, key_padding_mask=None, chunk_size=64
                ),
                fq.device,
            )

    per_token = (peak(16384) - peak(8192)) / 8192  # beyond one group of chunks (GROUP = 4096)
    assert per_token < 0.05 * d_feat * dv * 4  # a cumulative-sum form costs d_feat*dv*4 bytes per token


@pytest.mark.parametrize("name", ["elu", "toy-prf", "toy-trig"])
@pytest.mark.parametrize("pieces", [[1] * 12, [5, 7], [3, 1, 8]])
def test_decoding_state_resumes_exactly(use_registry, name: str, pieces: list[int]) -> None:
    """Feeding a sequence in pieces with the returned state equals one causal call:
    the normaliser never misses past keys when resuming from a cached state."""
    q, k, v = qkv(n=12, d=8, seed=13)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, :2] = True  # padding at the start of batch 0
    mask[1, 6] = True
    est = ka.create(name, seed=4, chunk_size=4)
    full = est(q, k, v, causal=True, key_padding_mask=mask)
    state, outs, start = None, [], 0
    for size in pieces:
        sl = slice(start, start + size)
        out, state = est.step(q[:, :, sl], k[:, :, sl], v[:, :, sl], state, key_padding_mask=mask[:, sl])
        outs.append(out)
        start += size
    assert state.length == 12
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-10, atol=1e-12)


def test_decoding_with_a_large_late_key_stays_finite(use_registry) -> None:
    q, k, v = qkv(b=1, h=1, n=6, d=8, seed=1, dtype=torch.float32)
    k = k.clone()
    k[:, :, 4] = 30.0
    est = ka.create("toy-prf", seed=0)
    full = est(q, k, v, causal=True)
    state, outs = None, []
    for t in range(6):
        out, state = est.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        outs.append(out)
    assert torch.isfinite(torch.cat(outs, 2)).all()
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fully_masked_rows_have_finite_gradients(use_registry, dtype: torch.dtype) -> None:
    """A query with no allowed key outputs zeros with zero, finite gradients (a tiny
    denominator's reciprocal would overflow in the backward pass)."""
    q, k, v = (t.requires_grad_(True) for t in qkv(b=1, h=1, n=6, d=4, dtype=dtype, seed=3))
    mask = torch.zeros(1, 6, dtype=torch.bool)
    mask[0, :2] = True
    for name in ("elu", "toy-prf"):
        est = ka.create(name, seed=0).to(dtype)
        out = est(q, k, v, causal=True, key_padding_mask=mask)
        grads = torch.autograd.grad((100.0 * out).sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)
        assert (grads[0][..., :2, :] == 0).all()  # the empty rows send no gradient to their queries


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_exact_sdpa_path_equals_naive_reference_outputs_and_gradients(causal: bool, padded: bool) -> None:
    q, k, v = qkv(n=9, d=8, seed=21)
    mask = _padding(2, 9) if padded else None
    if padded:
        mask[0, :] = True  # batch 0: every key padded (zeros, not NaN, and zero gradients)
    results = []
    for backend in ("sdpa", "naive"):
        est = ka.ExactAttention(backend=backend)
        a, b, c = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = est(a, b, c, causal=causal, key_padding_mask=mask)
        assert est.last_backend == backend
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        results.append((out, a.grad, b.grad, c.grad))
    for fast, ref in zip(*results):
        assert torch.isfinite(fast).all()
        torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)
    if padded:
        assert (results[0][0][0] == 0).all()


def test_exact_backend_option_errors() -> None:
    with pytest.raises(ka.InputError, match="backend: expected 'auto', 'sdpa' or 'naive'"):
        ka.ExactAttention(backend="fast")
    assert ka.create("softmax").backend == "sdpa"
