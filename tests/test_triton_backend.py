"""The Triton backend against the torch backend and the quadratic reference.

Without a GPU the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` is
set here before Triton is imported): tiny shapes, a few parametrisations, about a
minute in all. Shapes cross chunk boundaries (``N = 37`` with chunks of 16: two full
chunks and a partial one), and ``block_v=16`` splits ``d_v = 24`` over two programs so
the partial query/key gradients are summed. Tests marked ``gpu`` run the compiled
kernels at larger sizes when CUDA exists.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

import kernelattn_core as ka
from kernelattn_core.builtins.estimators import FeatureMapAttention
from kernelattn_core.engine.naive import feature_attention_naive
from kernelattn_core.engine.torch_backend import feature_attention_step, feature_attention_torch
from kernelattn_core.errors import InputError

T = pytest.importorskip("kernelattn_core.engine.triton_backend")
B = sys.modules["kernelattn_core.engine.backends"]  # the module (engine.backends is also a function)

interp = pytest.mark.skipif(not T.interpreting(), reason="needs TRITON_INTERPRET=1 (CPU interpreter)")
gpu = pytest.mark.gpu


def _inputs(log_space: bool, dtype=torch.float64, b=2, h=1, n=37, d=20, dv=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    pq = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    pk = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    if not log_space:
        pq, pk = pq.exp(), pk.exp()
    v = torch.randn(b, h, n, dv, generator=g, dtype=torch.float64)
    mask = torch.zeros(b, n, dtype=torch.bool)
    mask[0, :3] = True  # left padding
    mask[1, 30:] = True  # ragged: the second sequence is 30 long
    return pq.to(dtype), pk.to(dtype), v.to(dtype), mask


def _run_with_grads(fn, pq, pk, v, seed=1, **kw):
    pq, pk, v = (t.clone().requires_grad_() for t in (pq, pk, v))
    num, den = fn(pq, pk, v, **kw)
    g = torch.Generator().manual_seed(seed)
    gn = torch.randn(num.shape, generator=g, dtype=torch.float64).to(num.dtype)
    gd = torch.randn(den.shape, generator=g, dtype=torch.float64).to(den.dtype)
    ((num * gn).sum() + (den * gd).sum()).backward()
    return num, den, pq.grad, pk.grad, v.grad


@interp
@pytest.mark.parametrize("log_space", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_num_den_and_gradients_equal_torch_backend_float64(log_space, causal):
    """Same stabilisers as the torch backend, so num and den agree (not only their ratio),
    with padding, ragged lengths, a partial last chunk and d_v split over two programs."""
    pq, pk, v, mask = _inputs(log_space)
    kw = dict(log_space=log_space, causal=causal, key_padding_mask=mask, chunk_size=16)
    got = _run_with_grads(T.feature_attention_triton, pq, pk, v, block_v=16, **kw)
    ref = _run_with_grads(feature_attention_torch, pq, pk, v, **kw)
    for name, a, r in zip(("num", "den", "d phi_q", "d phi_k", "d v"), got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10, msg=name)


def _ratio(num, den):
    return num / torch.where(den == 0, torch.ones_like(den), den).unsqueeze(-1)


@interp
@pytest.mark.parametrize("causal", [True, False])
def test_float32_within_1e5_of_naive_reference_outputs_and_gradients(causal):
    pq, pk, v, mask = _inputs(True, torch.float32)

    def out(fn, a, b_, c, **kw):
        a, b_, c = (t.clone().requires_grad_() for t in (a, b_, c))
        o = _ratio(*fn(a, b_, c, log_space=True, causal=causal, key_padding_mask=mask, **kw))
        o.square().sum().backward()
        return o, a.grad, b_.grad, c.grad

    got = out(T.feature_attention_triton, pq, pk, v, chunk_size=16)
    ref = out(feature_attention_naive, pq.double(), pk.double(), v.double())
    for name, a, r in zip(("out", "d phi_q", "d phi_k", "d v"), got, ref):
        assert a.dtype == torch.float32
        err = ((a.double() - r).abs().max() / r.abs().max()).item()
        assert err < 1e-5, f"{name}: relative error {err:.2e}"


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_accumulate_in_float32(dtype):
    """Half values, float32 accumulation: the output equals the float32 computation on the
    same rounded values (a half accumulator over 37 positions would be off by ~1e-2)."""
    pq, pk, v, mask = _inputs(True, torch.float32)
    v = v.to(dtype)
    num, den = T.feature_attention_triton(pq, pk, v, log_space=True, causal=True, key_padding_mask=mask)
    assert num.dtype == torch.float32
    ref = _ratio(
        *feature_attention_naive(
            pq.double(), pk.double(), v.double(), log_space=True, causal=True, key_padding_mask=mask
        )
    )
    torch.testing.assert_close(_ratio(num, den).double(), ref, rtol=1e-5, atol=1e-6)


@interp
def test_causal_prefix_invariance_and_nan_at_padded_positions():
    pq, pk, v, mask = _inputs(True, torch.float32)
    kw = dict(log_space=True, causal=True, key_padding_mask=mask, chunk_size=16)
    num, den = T.feature_attention_triton(pq, pk, v, **kw)
    t = 20  # inside the second chunk: later positions of the same chunk change too
    pk2, v2 = pk.clone(), v.clone()
    pk2[:, :, t + 1 :] += 50.0  # a much larger later key would move a non-causal stabiliser
    v2[:, :, t + 1 :] = 1e6
    num2, den2 = T.feature_attention_triton(pq, pk2, v2, **kw)
    torch.testing.assert_close(num2[:, :, : t + 1], num[:, :, : t + 1], rtol=0, atol=0)
    torch.testing.assert_close(den2[:, :, : t + 1], den[:, :, : t + 1], rtol=0, atol=0)
    assert not torch.allclose(num2[:, :, t + 1 :], num[:, :, t + 1 :])
    # whatever sits at a padded position (NaN included) never reaches an output
    pk3, v3 = pk.clone(), v.clone()
    pk3[mask[:, None, :].expand(pk.shape[:3])] = float("nan")
    v3[mask[:, None, :].expand(v.shape[:3])] = float("nan")
    for causal in (True, False):
        kw["causal"] = causal
        a = T.feature_attention_triton(pq, pk, v, **kw)
        c = T.feature_attention_triton(pq, pk3, v3, **kw)
        torch.testing.assert_close(c, a, rtol=0, atol=0)


@interp
def test_step_pieces_equal_one_causal_call_and_gradcheck_through_state():
    pq, pk, v, _ = _inputs(True)
    whole = feature_attention_torch(pq, pk, v, log_space=True, causal=True, key_padding_mask=None)
    state, nums, dens = None, [], []
    ref_state = None
    for a, b_ in ((0, 20), (20, 21), (21, 37)):  # a chunk, one token (decoding), the rest
        num, den, state = T.feature_attention_step_triton(
            pq[:, :, a:b_], pk[:, :, a:b_], v[:, :, a:b_], log_space=True, key_padding_mask=None, state=state
        )
        *_, ref_state = feature_attention_step(
            pq[:, :, a:b_], pk[:, :, a:b_], v[:, :, a:b_], log_space=True, key_padding_mask=None, state=ref_state
        )
        nums.append(num)
        dens.append(den)
    torch.testing.assert_close(torch.cat(nums, 2), whole[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(dens, 2), whole[1], rtol=1e-12, atol=1e-12)
    assert state.length == 37
    torch.testing.assert_close(state.kv, ref_state.kv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state.z, ref_state.z, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state.m, ref_state.m, rtol=0, atol=0)

    # float64 gradcheck through a state: a call continuing a given state, then a call
    # continuing the state it returns. Ratios num/den are checked (num and den alone are
    # stated at stabilisers that are constants for autograd, as in the torch backend).
    g = torch.Generator().manual_seed(3)
    lq, lk, vv = (torch.randn(1, 1, 5, 3, generator=g, dtype=torch.float64) for _ in range(3))
    kv0 = torch.rand(1, 1, 3, 3, generator=g, dtype=torch.float64)
    z0 = torch.rand(1, 1, 3, generator=g, dtype=torch.float64) + 0.5
    m0 = torch.full((1, 1, 1), 0.5, dtype=torch.float64)

    def f(lq, lk, vv, kv0, z0):
        st = ka.engine.CausalState(kv0, z0, m0, 4)
        kw = dict(log_space=True, key_padding_mask=None)
        n1, d1, nxt = T.feature_attention_step_triton(lq[:, :, :3], lk[:, :, :3], vv[:, :, :3], state=st, **kw)
        n2, d2, _ = T.feature_attention_step_triton(lq[:, :, 3:], lk[:, :, 3:], vv[:, :, 3:], state=nxt, **kw)
        return _ratio(n1, d1), _ratio(n2, d2)

    inputs = tuple(t.requires_grad_() for t in (lq, lk, vv, kv0, z0))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, fast_mode=True)


# ---------------------------------------------------------------- fused feature maps
FUSED = [
    ("prf", {}),
    ("prf-hyperbolic", {}),
    (
        "cexp",
        {
            "rule": "fixed",
            "matrix": [[1.2, 0.3, 0.0, 0.1], [0.0, 0.9, 0.2, 0.0], [0.1, 0.0, 1.1, 0.0], [0.0, 0.2, 0.0, 0.8]],
        },
    ),
    ("rff", {}),
    ("rff", {"variant": "offset"}),
    ("trig-softmax-features", {}),
]


def _estimator(name, opts, d=4, m=8):
    pytest.importorskip("kernelattn_prf")
    pytest.importorskip("kernelattn_fourier")
    torch.manual_seed(0)
    return FeatureMapAttention(name, num_features=m, head_dim=d, **opts).double().eval()


@pytest.mark.parametrize(("name", "opts"), FUSED, ids=[f"{n}-{i}" for i, (n, _) in enumerate(FUSED)])
def test_fused_spec_reproduces_the_kernel_estimate(name, opts):
    """The spec's on-chip features give the same phi_q phi_k^T as the features the engine
    would otherwise consume (``raw_features``: the map's own features, less any per-query
    factor that cancels, as the trig-softmax maps leave out; the contract of fused_spec;
    order of features is free). No Triton needed."""
    fm = _estimator(name, opts).feature_map
    spec = fm.fused_spec()
    assert spec is not None
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)

    def feats(t, query):
        xt = spec.transform(t, query)
        u = xt @ spec.omega.mT
        if spec.family == "exp":
            return (u + spec.row(xt, query)[..., None]).exp()
        phase = 0.0 if spec.phase is None else spec.phase
        return spec.row(xt, query)[..., None] * torch.cos(u + phase)

    rq, rk = fm.raw_features(x, query=True), fm.raw_features(y, query=False)
    if fm.log_space:
        rq, rk = rq.exp(), rk.exp()
    torch.testing.assert_close(feats(x, True) @ feats(y, False).mT, rq @ rk.mT, rtol=1e-12, atol=1e-12)


@interp
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("name", "opts"), [FUSED[1], FUSED[2], FUSED[4], FUSED[5]], ids=["prfh", "cexp", "rffo", "ts"])
def test_fused_triton_equals_torch_backend_outputs_and_gradients(name, opts, causal, monkeypatch):
    est = _estimator(name, opts)
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 2, 21, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 2, 21, 8, generator=g, dtype=torch.float64)
    mask = torch.zeros(2, 21, dtype=torch.bool)
    mask[1, 15:] = True

    def run(backend):
        a, b_, c = (t.clone().requires_grad_() for t in (q, k, v))
        out = ka.kernel_attention(a, b_, c, est, causal=causal, key_padding_mask=mask, backend=backend)
        out.square().sum().backward()
        return out, a.grad, b_.grad, c.grad

    ref = run("torch")

    def no_materialised_features(*args, **kwargs):
        raise AssertionError("the fused path materialised the features")

    monkeypatch.setattr(est.feature_map, "raw_features", no_materialised_features)
    got = run("triton")
    assert est.last_backend == "triton"
    for what, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-10, msg=what)


@interp
def test_map_without_fused_spec_falls_back_to_materialised_features():
    est = FeatureMapAttention("elu", head_dim=4).double()
    assert est.feature_map.fused_spec() is None
    q, k, v = (torch.randn(1, 2, 19, 4, dtype=torch.float64) for _ in range(3))
    out = ka.kernel_attention(q, k, v, est, causal=True, backend="triton")
    assert est.last_backend == "triton"
    torch.testing.assert_close(
        out, ka.kernel_attention(q, k, v, est, causal=True, backend="torch"), rtol=1e-12, atol=1e-12
    )


# ---------------------------------------------------------------- selection and errors
def _problem(device: str, dtype=torch.float32):
    return B.Problem(torch.device(device), dtype, True, True, True)


def test_auto_selection_picks_triton_for_cuda_and_torch_for_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert B.select_backend(_problem("cuda")).name == "triton"
    assert B.select_backend(_problem("cuda", torch.float64)).name == "torch"  # no fp64 kernels on GPU
    assert B.select_backend(_problem("cpu")).name == "torch"  # the interpreter only when asked for


def test_forced_triton_that_cannot_run_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    est = FeatureMapAttention("elu", head_dim=4)
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(InputError, match=r"backend: 'triton'.*TRITON_INTERPRET=1"):
        ka.kernel_attention(q, q, q, est, backend="triton")
    with pytest.raises(InputError, match=r"backend: expected 'auto' or one of"):
        ka.kernel_attention(q, q, q, est, backend="cuda")
    with pytest.raises(InputError, match=r"does not run through feature-attention backends"):
        ka.kernel_attention(q, q, q, ka.create("softmax"), backend="triton")
    assert est.backend is None  # a forced backend is for one call only
    monkeypatch.setattr(B.importlib.util, "find_spec", lambda name: None)  # triton not installed
    with pytest.raises(InputError, match=r"not available on this machine.*kernelattn-core\[triton\]"):
        B.select_backend(_problem("cpu"), "triton")


# ---------------------------------------------------------------- GPU (full sizes)
@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_fused_prf_matches_torch_backend(dtype, causal):
    est = _estimator("prf", {}, d=64, m=128).float().cuda()
    q, k, v = (torch.randn(2, 4, 2048, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    out = ka.kernel_attention(q, k, v, est, causal=causal, backend="triton")
    assert est.last_backend == "triton"
    ref = ka.kernel_attention(q.float(), k.float(), v.float(), est, causal=causal, backend="torch")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    (gq,) = torch.autograd.grad(out.float().square().sum(), q)
    (rq,) = torch.autograd.grad(ref.square().sum(), q)
    torch.testing.assert_close(gq.float(), rq.float(), rtol=10 * tol, atol=10 * tol)


def test_more_than_128_features_on_cuda_run_the_torch_computation(monkeypatch):
    """Wider than the compiled kernels' shared memory allows: the same numbers from torch
    (fused specs are turned into features first). Forced here on the CPU."""
    monkeypatch.setattr(T, "_too_wide", lambda v, d: True)
    est = _estimator("prf-hyperbolic", {})
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = ka.kernel_attention(q, k, v, est, causal=True, backend="triton")
    ref = ka.kernel_attention(q, k, v, est, causal=True, backend="torch")
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    r = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g, r):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
