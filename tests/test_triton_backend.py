"""The Triton backend against the torch backend and the quadratic reference.

Without a GPU the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` is
set here before Triton is imported), with bfloat16 and TF32 dot operands rounded as the
GPU rounds them (:func:`~kernelattn_core.engine.triton_backend.tiles` shrinks the
tiles so small shapes cross chunk and tile boundaries: ``N = 37`` with chunks of 16 is
two full chunks and a partial one; ``D = 20`` and ``d_v = 24`` span two tiles of 16 and
are padded to row strides of 32). Tests marked ``gpu`` run the compiled kernels when
CUDA exists. The compile test (resources on ``sm_80`` / ``sm_90``) is
``tests/test_triton_compile.py``; the randomised sweep ``tests/test_triton_sweep.py``.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

import kernelattn_core as ka
from kernelattn_core.builtins.estimators import FeatureMapAttention
from kernelattn_core.engine import triton_config as C
from kernelattn_core.engine.naive import feature_attention_naive
from kernelattn_core.engine.torch_backend import CausalState, feature_attention_step, feature_attention_torch
from kernelattn_core.errors import InputError

T = pytest.importorskip("kernelattn_core.engine.triton_backend")
B = sys.modules["kernelattn_core.engine.backends"]  # the module (engine.backends is also a function)

interp = pytest.mark.skipif(not T.interpreting(), reason="needs TRITON_INTERPRET=1 (CPU interpreter)")
gpu = pytest.mark.gpu
SMALL = {"bt": 16, "bk": 16, "bv": 16, "be": 16}


@pytest.fixture
def small_tiles():
    if not T.interpreting():
        pytest.skip("tile overrides are for the interpreter")
    with T.tiles(**SMALL):
        yield


def _inputs(log_space: bool, dtype=torch.float64, b=2, h=1, n=37, d=20, dv=24, seed=0, m=None):
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    pq = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    pk = torch.randn(b, h, m, d, generator=g, dtype=torch.float64)
    if not log_space:
        pq, pk = pq.exp(), pk.exp()
    v = torch.randn(b, h, m, dv, generator=g, dtype=torch.float64)
    mask = torch.zeros(b, m, dtype=torch.bool)
    mask[0, :3] = True  # left padding
    mask[1, 30:] = True  # ragged: the second sequence is 30 long
    return pq.to(dtype), pk.to(dtype), v.to(dtype), mask


def _run_with_grads(fn, pq, pk, v, seed=1, **kw):
    pq, pk, v = (t.clone().requires_grad_() for t in (pq, pk, v))
    num, den = fn(pq, pk, v, **kw)
    g = torch.Generator().manual_seed(seed)
    gn = torch.randn(num.shape, generator=g, dtype=torch.float64).to(num.dtype)
    gd = torch.randn(den.shape, generator=g, dtype=torch.float64).to(den.dtype)
    ((num * gn).nan_to_num().sum() + (den * gd).nan_to_num().sum()).backward()
    return num, den, pq.grad, pk.grad, v.grad


def _ratio(num, den):
    return num / torch.where(den == 0, torch.ones_like(den), den).unsqueeze(-1)


# ------------------------------------------------------------------ against the torch backend
@interp
@pytest.mark.parametrize("log_space", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_num_den_and_gradients_equal_torch_backend_float64(log_space, causal, small_tiles):
    """Same stabilisers as the torch backend, so num and den agree (not only their ratio),
    with padding, ragged lengths, a partial last chunk, D and d_v over two tiles each."""
    pq, pk, v, mask = _inputs(log_space)
    kw = dict(log_space=log_space, causal=causal, key_padding_mask=mask)
    got = _run_with_grads(T.feature_attention_triton, pq, pk, v, **kw)
    ref = _run_with_grads(feature_attention_torch, pq, pk, v, **kw)
    for name, a, r in zip(("num", "den", "d phi_q", "d phi_k", "d v"), got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10, msg=name)


@interp
@pytest.mark.parametrize("log_space", [True, False])
def test_cross_attention_more_keys_than_queries(log_space, small_tiles):
    pq, pk, v, mask = _inputs(log_space, n=19, m=37)
    kw = dict(log_space=log_space, causal=False, key_padding_mask=mask)
    got = _run_with_grads(T.feature_attention_triton, pq, pk, v, **kw)
    ref = _run_with_grads(feature_attention_torch, pq, pk, v, **kw)
    for name, a, r in zip(("num", "den", "d phi_q", "d phi_k", "d v"), got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10, msg=name)


@interp
def test_table_tiles_agree_with_small_tiles():
    """The launch table's own tiles (chunks of 64, tiles of 64) give the numbers the small
    test tiles give: the result does not depend on the tiling beyond rounding."""
    pq, pk, v, _ = _inputs(True, n=70, d=40, dv=72)
    kw = dict(log_space=True, causal=True, key_padding_mask=None)
    a = T.feature_attention_triton(pq, pk, v, **kw)
    with T.tiles(**SMALL):
        b = T.feature_attention_triton(pq, pk, v, **kw)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


@interp
@pytest.mark.parametrize("causal", [True, False])
def test_float32_within_1e5_of_naive_reference_outputs_and_gradients(causal, small_tiles):
    pq, pk, v, mask = _inputs(True, torch.float32)

    def out(fn, a, b_, c):
        a, b_, c = (t.clone().requires_grad_() for t in (a, b_, c))
        o = _ratio(*fn(a, b_, c, log_space=True, causal=causal, key_padding_mask=mask))
        o.square().sum().backward()
        return o, a.grad, b_.grad, c.grad

    got = out(T.feature_attention_triton, pq, pk, v)
    ref = out(feature_attention_naive, pq.double(), pk.double(), v.double())
    for name, a, r in zip(("out", "d phi_q", "d phi_k", "d v"), got, ref):
        assert a.dtype == torch.float32
        err = ((a.double() - r).abs().max() / r.abs().max()).item()
        assert err < 1e-5, f"{name}: relative error {err:.2e}"


# ----------------------------------------------------------------- half precision, emulated
#: relative-RMS bounds (outputs, gradients) of log-space maps with half inputs against the
#: float64 computation on the same rounded values. Measured over three seeds (this test's
#: shapes): bfloat16 3.6e-3 and up to 5.3e-2 (the log-feature gradient is a covariance,
#: sum_j P_tj (v_j - out_t) / den_t, whose cancellation amplifies the half forward's
#: rounding), float16 1.9e-4 and 2.8e-3
HALF_BOUND = {torch.bfloat16: (1e-2, 1e-1), torch.float16: (1e-3, 6e-3)}


def _rel(a, r):
    """Relative RMS error of ``a`` against the reference ``r``."""
    return ((a.double() - r).norm() / r.norm()).item()


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_of_log_maps_within_per_dtype_bounds_with_gpu_rounding(dtype, small_tiles, monkeypatch):
    """Half values, half in-chunk operands and TF32 state and gradient operands rounded as
    the tensor cores round them, float32 accumulation: within the dtype's bounds of the
    float64 computation on the same rounded values, outputs and gradients. Controls: a
    float32 call on the same values is 100x closer (the bounds measure the half operands,
    not slack), and leaving TF32 exact (KERNELATTN_TRITON_TF32=0) changes the result (the
    rounding is active)."""
    pq, pk, v, mask = _inputs(True, torch.float32)
    v = v.to(dtype)
    kw = dict(log_space=True, causal=True, key_padding_mask=mask)

    def out(fn, a, b_, c):
        a, b_, c = (t.clone().requires_grad_() for t in (a, b_, c))
        o = _ratio(*fn(a, b_, c, **kw))
        o.square().sum().backward()
        return o, a.grad, b_.grad, c.grad

    got = out(T.feature_attention_triton, pq, pk, v)
    ref = out(feature_attention_naive, pq.double(), pk.double(), v.double())
    exact = out(T.feature_attention_triton, pq, pk, v.float())
    for i, (name, a, r, e) in enumerate(zip(("out", "d phi_q", "d phi_k", "d v"), got, ref, exact)):
        bound = HALF_BOUND[dtype][min(i, 1)]
        err = _rel(a, r)
        assert err < bound, f"{name}: relative RMS {err:.2e}, max abs {(a.double() - r).abs().max():.2e}"
        assert _rel(e, r) < bound / 100, f"{name}: the float32 control"
    monkeypatch.setenv("KERNELATTN_TRITON_TF32", "0")
    untouched = out(T.feature_attention_triton, pq, pk, v)
    assert not torch.equal(untouched[1], got[1]), "the TF32 rounding changed nothing"


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_of_plain_maps_are_computed_in_float32(dtype, small_tiles):
    """Plain maps (unbounded, signed features) compute in IEEE float32 whatever the input
    dtype: equal to the float32 call on the same values; the value gradient is rounded
    to the values' dtype."""
    pq, pk, v, mask = _inputs(False, torch.float32)
    v = v.to(dtype)
    kw = dict(log_space=False, causal=True, key_padding_mask=mask)
    got = _run_with_grads(T.feature_attention_triton, pq, pk, v, **kw)
    ref = _run_with_grads(T.feature_attention_triton, pq, pk, v.float(), **kw)
    for name, a, r in zip(("num", "den", "d phi_q", "d phi_k"), got, ref):
        torch.testing.assert_close(a, r, rtol=0, atol=0, msg=name)
    assert got[4].dtype == dtype
    torch.testing.assert_close(got[4], ref[4].to(dtype), rtol=0, atol=0)


@interp
def test_tf32_rounding_matches_cvt_rna():
    """The kernels' TF32 rounding (``_tf32``, run in the interpreter): 10 mantissa bits, to
    nearest, ties away from zero, as ``cvt.rna.tf32.f32``."""
    import triton
    import triton.language as tl

    @triton.jit
    def rounding(X, Y):
        i = tl.arange(0, 8)
        tl.store(Y + i, T.K._tf32(tl.load(X + i)))

    x = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, -(1 + 2.0**-11), 1 + 2.0**-12, 3.0, 0.0, -2.5, 1 + 2.0**-10])
    y = torch.empty_like(x)
    rounding[(1,)](x, y)
    expect = torch.tensor([1 + 2.0**-10, 1 + 2 * 2.0**-10, -(1 + 2.0**-10), 1.0, 3.0, 0.0, -2.5, 1 + 2.0**-10])
    torch.testing.assert_close(y, expect, rtol=0, atol=0)


# ---------------------------------------------------------------------- isolation
@interp
def test_causal_prefix_invariance_and_nan_at_padded_positions(small_tiles):
    pq, pk, v, mask = _inputs(True, torch.float32)
    kw = dict(log_space=True, causal=True, key_padding_mask=mask)
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
@pytest.mark.parametrize("what", ["k-nan", "k-inf", "v-nan", "v-inf", "q-nan"])
@pytest.mark.parametrize("log_space", [True, False], ids=["log", "plain"])
def test_non_finite_inside_a_chunk_reaches_only_the_rows_that_see_it(what, log_space, small_tiles):
    """A NaN or inf future key or value at position 21 (inside the second chunk, 5 rows
    in), or a NaN query there: the rows before it keep the outputs and gradients of a
    call without it (bit for bit), the rows that see it are NaN, and the torch backend
    gives the same everywhere. Before this change the earlier rows of the chunk were NaN
    (0 * NaN in the in-chunk products)."""
    pq, pk, v, _ = _inputs(log_space)
    j = 21
    bad = float("nan") if what.endswith("nan") else float("inf")
    tensors = {"q": pq.clone(), "k": pk.clone(), "v": v.clone()}
    tensors[what[0]][0, :, j, 3] = bad  # batch 0 only; batch 1 stays clean
    kw = dict(log_space=log_space, causal=True, key_padding_mask=None)

    def run(fn, a, b_, c):
        a, b_, c = (t.clone().requires_grad_() for t in (a, b_, c))
        num, den = fn(a, b_, c, **kw)
        out = _ratio(num, den)
        keep = torch.ones(out.shape[2], dtype=torch.bool)
        keep[j if what[0] == "q" else slice(j, None)] = False
        out[0, :, keep].square().sum().backward()
        return out, a.grad, b_.grad, c.grad, keep

    got = run(T.feature_attention_triton, tensors["q"], tensors["k"], tensors["v"])
    clean = run(T.feature_attention_triton, pq, pk, v)
    ref = run(feature_attention_torch, tensors["q"], tensors["k"], tensors["v"])
    out, keep = got[0], got[4]
    assert bool(torch.isnan(out[0, :, ~keep]).all()), "a row that sees the non-finite value is not NaN"
    assert bool(torch.isfinite(out[:, :, keep]).all() and torch.isfinite(out[1]).all())
    torch.testing.assert_close(out[:, :, :j], clean[0][:, :, :j], rtol=0, atol=0)
    others = torch.ones(out.shape[2], dtype=torch.bool)
    others[j] = False
    for name, a, c, r in zip(("dq", "dk", "dv"), got[1:4], clean[1:4], ref[1:4]):
        assert bool(torch.isfinite(a[:, :, others]).all()), f"{name}: NaN reached another position"
        torch.testing.assert_close(a[:, :, :j], c[:, :, :j], rtol=0, atol=0, msg=name)  # the clean call's
        torch.testing.assert_close(a[:, :, others], r[:, :, others], rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(out, ref[0], rtol=1e-10, atol=1e-12, equal_nan=True)


# ---------------------------------------------------------------------------- decoding
@interp
def test_step_pieces_equal_one_causal_call_and_gradcheck_through_state(small_tiles):
    pq, pk, v, _ = _inputs(True)
    whole = feature_attention_torch(pq, pk, v, log_space=True, causal=True, key_padding_mask=None)
    state, nums, dens = None, [], []
    ref_state = None
    for a, b_ in ((0, 20), (20, 21), (21, 37)):  # a chunk and a bit, one token (decoding), the rest
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
    assert not bool(state.poisoned.any())

    # float64 gradcheck through a state: a call continuing a given state, then a call
    # continuing the state it returns. Ratios num/den are checked (num and den alone are
    # stated at stabilisers that are constants for autograd, as in the torch backend).
    g = torch.Generator().manual_seed(3)
    lq, lk, vv = (torch.randn(1, 1, 5, 3, generator=g, dtype=torch.float64) for _ in range(3))
    kv0 = torch.rand(1, 1, 3, 3, generator=g, dtype=torch.float64)
    z0 = torch.rand(1, 1, 3, generator=g, dtype=torch.float64) + 0.5
    m0 = torch.full((1, 1, 1), 0.5, dtype=torch.float64)

    def f(lq, lk, vv, kv0, z0):
        st = CausalState(kv0, z0, m0, 4)
        kw = dict(log_space=True, key_padding_mask=None)
        n1, d1, nxt = T.feature_attention_step_triton(lq[:, :, :3], lk[:, :, :3], vv[:, :, :3], state=st, **kw)
        n2, d2, _ = T.feature_attention_step_triton(lq[:, :, 3:], lk[:, :, 3:], vv[:, :, 3:], state=nxt, **kw)
        return _ratio(n1, d1), _ratio(n2, d2)

    inputs = tuple(t.requires_grad_() for t in (lq, lk, vv, kv0, z0))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, fast_mode=True)


@interp
@pytest.mark.parametrize("log_space", [True, False], ids=["log", "plain"])
def test_step_poisoned_flag_set_by_a_consumed_non_finite_value(log_space):
    """Decoding a NaN value in head 1 of batch 0: that head's flag is set and every later
    row of it is NaN, whatever comes next; other heads and the rows before stay finite;
    the torch step sets the same flags and gives the same numbers."""
    pq, pk, v, _ = _inputs(log_space, b=2, h=2, n=6, d=4, dv=3)
    v = v.clone()
    v[0, 1, 2, 0] = float("nan")
    kw = dict(log_space=log_space, key_padding_mask=None)
    state = ref_state = None
    flags = []
    for t in range(6):
        sl = slice(t, t + 1)
        num, den, state = T.feature_attention_step_triton(pq[:, :, sl], pk[:, :, sl], v[:, :, sl], state=state, **kw)
        rn, rd, ref_state = feature_attention_step(pq[:, :, sl], pk[:, :, sl], v[:, :, sl], state=ref_state, **kw)
        torch.testing.assert_close(num, rn, rtol=1e-12, atol=1e-12, equal_nan=True)
        torch.testing.assert_close(den, rd, rtol=1e-12, atol=1e-12, equal_nan=True)
        flags.append(state.poisoned.clone())
        expect = torch.zeros(2, 2, dtype=torch.bool)
        expect[0, 1] = t >= 2
        assert torch.equal(state.poisoned, expect), f"step {t}: flag {state.poisoned.tolist()}"
        if ref_state.poisoned is not None:
            assert torch.equal(ref_state.poisoned, expect)
        assert bool(torch.isnan(num[0, 1]).all()) == (t >= 2)
        assert bool(torch.isfinite(num[1]).all() and torch.isfinite(num[0, 0]).all())


@interp
@pytest.mark.parametrize("name", ["prf", "elu"])
def test_estimator_step_runs_the_triton_step(name, monkeypatch):
    """``estimator.step`` goes through the backend a forward call would take: forced to
    triton (the interpreter), its step runs (not the torch step) and equals it."""
    torch.manual_seed(0)
    est = FeatureMapAttention(name, num_features=8, head_dim=4).double().eval()
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    ref_outs, st = [], None
    for t in range(5):
        out, st = est.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], st)
        ref_outs.append(out)
    assert est.last_backend == "torch"  # auto never picks the interpreter
    calls = []
    real = T.feature_attention_step_triton
    monkeypatch.setattr(T, "feature_attention_step_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    est.backend = "triton"
    outs, st = [], None
    for t in range(5):
        out, st = est.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], st)
        outs.append(out)
    assert est.last_backend == "triton" and len(calls) == 5
    torch.testing.assert_close(torch.cat(outs, 2), torch.cat(ref_outs, 2), rtol=1e-12, atol=1e-12)
    whole = est(q, k, v, causal=True)
    torch.testing.assert_close(torch.cat(outs, 2), whole, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------- second derivatives
@interp
@pytest.mark.parametrize("fused", [False, True], ids=["materialised", "fused"])
def test_noncausal_second_derivatives_gradgradcheck(fused):
    """create_graph=True, non-causal: the backward recomputes the torch computation under
    autograd, so second derivatives are right (gradgradcheck in float64). Before this
    change a gradient penalty came out as 1e-15 where torch gives 8.97."""
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 7, 3, generator=g, dtype=torch.float64)
    if fused:
        torch.manual_seed(0)
        est = FeatureMapAttention("prf", num_features=6, head_dim=4).double().eval()
    else:
        est = FeatureMapAttention("elu", head_dim=4).double()

    def f(q, k, v):
        return ka.kernel_attention(q, k, v, est, causal=False, backend="triton")

    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradgradcheck(f, inputs, eps=1e-6, atol=1e-6, fast_mode=True)
    # the gradient penalty equals the torch backend's
    out = f(*inputs)
    (gq,) = torch.autograd.grad(out.square().sum(), inputs[0], create_graph=True)
    penalty = gq.square().sum()
    (pq_,) = torch.autograd.grad(penalty, inputs[0])
    ref = ka.kernel_attention(*inputs, est, causal=False, backend="torch")
    (rq,) = torch.autograd.grad(ref.square().sum(), inputs[0], create_graph=True)
    (rpq,) = torch.autograd.grad(rq.square().sum(), inputs[0])
    torch.testing.assert_close(penalty, rq.square().sum(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(pq_, rpq, rtol=1e-8, atol=1e-10)


@interp
def test_causal_second_derivatives_refused_like_the_torch_backend():
    est = FeatureMapAttention("elu", head_dim=4).double()
    q, k, v = (torch.randn(1, 1, 9, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    messages = []
    for backend in ("torch", "triton"):
        out = ka.kernel_attention(q, k, v, est, causal=True, backend=backend)
        with pytest.raises(InputError, match="create_graph") as info:
            torch.autograd.grad(out.sum(), q, create_graph=True)
        messages.append(str(info.value))
    assert messages[0] == messages[1] == T.CREATE_GRAPH_MESSAGE


# --------------------------------------------------------------------- fused feature maps
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
        f = T.spec_features(spec.family, xt, spec.row(xt, query), spec.omega, spec.phase)
        return f.exp() if spec.family == "exp" else f

    rq, rk = fm.raw_features(x, query=True), fm.raw_features(y, query=False)
    if fm.log_space:
        rq, rk = rq.exp(), rk.exp()
    torch.testing.assert_close(feats(x, True) @ feats(y, False).mT, rq @ rk.mT, rtol=1e-12, atol=1e-12)


@interp
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("name", "opts"), [FUSED[1], FUSED[2], FUSED[4], FUSED[5]], ids=["prfh", "cexp", "rffo", "ts"])
def test_fused_triton_equals_torch_backend_outputs_and_gradients(name, opts, causal, small_tiles, monkeypatch):
    """Features on chip (``d' = 4`` padded to 16, ``D = 16`` over one tile, or two for
    the two-sided ``prf-hyperbolic``), padded keys holding NaN included."""
    est = _estimator(name, opts)
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 2, 21, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 2, 21, 8, generator=g, dtype=torch.float64)
    mask = torch.zeros(2, 21, dtype=torch.bool)
    mask[1, 15:] = True
    k[1, :, 15:] = float("nan")
    v[1, :, 15:] = float("nan")

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
        assert bool(torch.isfinite(a).all()), what
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-10, msg=what)


@interp
# fixed with the feature maps' row isolation (FeatureMap._isolated): a padded NaN key enters the
# map as 0, so its own gradient is 0 on every backend (this was a strict xfail on the triton branch)
def test_padded_nan_key_of_a_materialised_map(small_tiles):
    """A padded key holding NaN: outputs and every other gradient are right (checked in
    the sweep), but the padded key's own gradient is NaN where the torch backend gives 0."""
    est = FeatureMapAttention("elu", head_dim=4).double()
    q, k, v = (torch.randn(1, 1, 9, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(1, 9, dtype=torch.bool)
    mask[0, 6:] = True
    k[0, 0, 7] = float("nan")
    k.requires_grad_()
    out = ka.kernel_attention(q, k, v, est, causal=True, key_padding_mask=mask, backend="triton")
    (gk,) = torch.autograd.grad(out.sum(), k)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(gk[0, 0, :6]).all())
    assert bool(torch.isfinite(gk).all()), "the padded NaN key's own gradient"


@interp
def test_map_without_fused_spec_falls_back_to_materialised_features(small_tiles):
    est = FeatureMapAttention("elu", head_dim=4).double()
    assert est.feature_map.fused_spec() is None
    q, k, v = (torch.randn(1, 2, 19, 4, dtype=torch.float64) for _ in range(3))
    out = ka.kernel_attention(q, k, v, est, causal=True, backend="triton")
    assert est.last_backend == "triton"
    torch.testing.assert_close(
        out, ka.kernel_attention(q, k, v, est, causal=True, backend="torch"), rtol=1e-12, atol=1e-12
    )


# ------------------------------------------------------------- selection, table, fallbacks
def _problem(device: str, dtype=torch.float32):
    return B.Problem(torch.device(device), dtype, True, True, True)


def test_auto_selection_picks_triton_for_cuda_and_torch_for_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert B.select_backend(_problem("cuda")).name == "triton"
    assert B.select_backend(_problem("cuda", torch.float64)).name == "torch"  # no fp64 kernels on GPU
    assert B.select_backend(_problem("cpu")).name == "torch"  # the interpreter only when asked for
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert B.select_backend(_problem("cuda")).name == "torch"  # below the table's sm_80
    with pytest.raises(InputError, match=r"compute capability 8.0"):
        B.select_backend(_problem("cuda"), "triton")


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
    monkeypatch.setattr(B, "_triton_installed", lambda: False)  # triton not installed
    with pytest.raises(InputError, match=r"not available on this machine.*kernelattn-core\[triton\]"):
        B.select_backend(_problem("cpu"), "triton")


def test_launch_table_keys_and_devices():
    """One table keyed by (arch, d, D, dtype): every listed key has an entry, wider shapes
    take the 256 entries (the kernels loop over D and d'), devices map to the entries."""
    assert len(C.TABLE) == len(C.ARCHS) * len(C.DIMS) ** 2 * len(C.DTYPES)
    assert C.table_key(90, 20, 100, "bfloat16") == (90, 32, 128, "bfloat16")
    assert C.table_key(80, 4096, 1000, "float32") == (80, 256, 256, "float32")
    assert C.arch_of((9, 0)) == 90 and C.arch_of((8, 6)) == 80 and C.arch_of((12, 0)) == 80
    assert C.arch_of((7, 5)) is None
    for cfg in C.TABLE.values():
        assert set(cfg.kernels) == set(C.KERNEL_NAMES)
        assert cfg.bt % 16 == 0 and all(
            k.bk % 16 == 0 and k.bv % 16 == 0 and k.be % 16 == 0 for k in cfg.kernels.values()
        )


def test_recorded_launches_follow_the_table():
    """The host code on an "sm_90" (recorded, not run): chunk and tiles from the table,
    grids from them, every kernel of the forward and backward pass."""
    pq, pk = (torch.randn(1, 2, 130, 200, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 2, 130, 96).to(torch.bfloat16).requires_grad_()
    with T.record_launches(90) as rec:
        num, den = T.feature_attention_triton(pq, pk, v, log_space=True, causal=True, key_padding_mask=None)
        (num.sum() + den.sum()).backward()
    cfg = C.lookup(90, 96, 200, "bfloat16")
    forward = ["prep", "prep", "state_fwd", "out_fwd"]
    backward = ["state_fwd", "state_bwd", "bwd_dv", "bwd_dq", "bwd_dk"]
    assert [r.name for r in rec] == [*forward, *backward]
    by = {r.name: r for r in rec}
    assert by["out_fwd"].constexprs["BT"] == cfg.bt and by["out_fwd"].key == (90, 128, 256, "bfloat16")
    sf = cfg.launch("state_fwd")
    assert by["state_fwd"].grid == (-(-200 // sf.bk), -(-96 // sf.bv), 2)
    assert by["out_fwd"].grid == (-(-96 // cfg.launch("out_fwd").bv), -(-130 // cfg.bt), 2)
    assert by["bwd_dk"].constexprs["SIDE"] == 1 and by["bwd_dq"].constexprs["SIDE"] == 0


def test_tile_overrides_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(T, "interpreting", lambda: False)
    with pytest.raises(InputError, match="tiles"), T.tiles(bt=16):
        pass


def _failing_kernel(name, monkeypatch):
    """Make the launch of kernel ``name`` fail as :func:`T._launch` reports a Triton
    launch failure (the wrapping itself: test_launch_failure_is_wrapped_with_the_shape)."""
    real = T._launch

    def launch(call, kname, grid, args, **cx):
        if kname == name:
            raise B.BackendLaunchError(f"backend 'triton': kernel {kname} could not be launched for {call.shape}")
        return real(call, kname, grid, args, **cx)

    monkeypatch.setattr(T, "_launch", launch)


@interp
def test_launch_failure_is_wrapped_with_the_shape(monkeypatch):
    """A Triton OutOfResources at launch becomes BackendLaunchError naming the kernel, the
    shape and the table entry (the real wrapper, with the kernel made to fail)."""
    from triton.runtime.errors import OutOfResources

    class Failing:
        arg_names = T.K.KERNELS["out_fwd"].arg_names

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                raise OutOfResources(300_000, 232_448, "shared memory")

            return run

    monkeypatch.setitem(T.K.KERNELS, "out_fwd", Failing())
    pq, pk, v, _ = _inputs(True, n=9, d=4, dv=3)
    with pytest.raises(B.BackendLaunchError, match=r"kernel out_fwd .*B=2, H=1, N=9, M=9, D=4, d'=4, d_v=3") as info:
        T.feature_attention_triton(pq, pk, v, log_space=True, causal=True, key_padding_mask=None)
    assert isinstance(info.value.__cause__, OutOfResources)


@interp
def test_driver_resource_errors_are_launch_failures_other_errors_are_not(monkeypatch):
    """CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (as Triton's driver reports it) is a launch
    failure like OutOfResources; any other RuntimeError (a bug) goes through unchanged."""

    def failing(message):
        class Failing:
            arg_names = T.K.KERNELS["prep"].arg_names

            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    raise RuntimeError(message)

                return run

        return Failing()

    pq, pk, v, _ = _inputs(True, n=9, d=4, dv=3)
    kw = dict(log_space=True, causal=True, key_padding_mask=None)
    monkeypatch.setitem(T.K.KERNELS, "prep", failing("Triton Error [CUDA]: too many resources requested for launch"))
    with pytest.raises(B.BackendLaunchError, match="kernel prep .*too many resources"):
        T.feature_attention_triton(pq, pk, v, **kw)
    monkeypatch.setitem(T.K.KERNELS, "prep", failing("something else"))
    with pytest.raises(RuntimeError, match="something else") as info:
        T.feature_attention_triton(pq, pk, v, **kw)
    assert not isinstance(info.value, B.BackendLaunchError)


@interp
@pytest.mark.parametrize("stage", ["out_fwd", "bwd_dk"], ids=["forward", "backward"])
def test_auto_falls_back_to_torch_with_one_warning_forced_raises(stage, monkeypatch):
    """backend="auto": a kernel that cannot be launched (forward or backward) leaves the
    call to the torch backend with a BackendWarning, and the numbers are torch's;
    backend="triton": the BackendLaunchError naming the shape."""
    _failing_kernel(stage, monkeypatch)
    torch.manual_seed(0)
    est = FeatureMapAttention("elu", head_dim=4).double()
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ref = ka.kernel_attention(q, k, v, est, causal=True, backend="torch")
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    # auto: let the triton backend be chosen for these CPU tensors
    triton_auto = dataclasses.replace(B._BACKENDS["triton"], auto=lambda problem: True)
    monkeypatch.setitem(B._BACKENDS, "triton", triton_auto)
    monkeypatch.setattr(B, "_WARNED", set())
    monkeypatch.setattr(T, "_WARNED", set())
    with pytest.warns(B.BackendWarning, match=f"kernel {stage} could not be launched.*torch backend"):
        out = est(q, k, v, causal=True)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert est.last_backend == ("torch" if stage == "out_fwd" else "triton")
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    with pytest.raises(B.BackendLaunchError, match=f"kernel {stage} .*N=9"):
        out = ka.kernel_attention(q, k, v, est, causal=True, backend="triton")
        torch.autograd.grad(out.square().sum(), (q, k, v))


@interp
def test_shape_outside_the_kernels_runs_torch_with_one_warning(monkeypatch):
    monkeypatch.setattr(T, "_MAX_OFFSET", 100)  # as if rows * width reached 2^31
    monkeypatch.setattr(T, "_WARNED", set())
    est = _estimator("prf-hyperbolic", {})
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    with pytest.warns(B.BackendWarning, match="2\\^31.*torch backend") as record:
        out = ka.kernel_attention(q, k, v, est, causal=True, backend="triton")
        ka.kernel_attention(q, k, v, est, causal=True, backend="triton")
    assert len([w for w in record if issubclass(w.category, B.BackendWarning)]) == 1
    ref = ka.kernel_attention(q, k, v, est, causal=True, backend="torch")
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    r = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g, r):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@interp
@pytest.mark.parametrize(("name", "opts"), [("cexp", {"rule": "full"}), ("hedgehog", {}), ("gmm-prf", {})])
def test_float32_under_autocast_is_computed_in_float32_as_the_torch_backend_does(name, opts):
    """Under bfloat16 autocast the map's own products (cexp's ``x @ A``, hedgehog's
    layers, gmm-prf's scales) ran in bfloat16 on the Triton path (output 2e-3-4e-3 off
    its float32 result, dq 4e-3-8e-3) while the torch backend computes in float32."""
    pytest.importorskip("kernelattn_hybrid")
    pytest.importorskip("kernelattn_spectral")
    torch.manual_seed(0)
    est = ka.create(name, num_features=16, head_dim=8, **opts).train()
    g = torch.Generator().manual_seed(0)
    q, k, v = (0.7 * torch.randn(1, 2, 24, 8, generator=g) for _ in range(3))
    if hasattr(est.feature_map, "fit"):
        est.feature_map.fit(q, k)
    est.eval()

    def run(autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        qq = q.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = ka.kernel_attention(qq, k, v, est, causal=True, backend="triton")
        (gq,) = torch.autograd.grad(out.float().square().sum(), qq)
        return out.float(), gq

    (out, gq), (ref, rq) = run(True), run(False)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gq, rq, rtol=1e-4, atol=1e-5)


@interp
@pytest.mark.parametrize(
    ("shape", "match"), [((4, 1, 9), "B \\* H = 4 heads exceed"), ((1, 2, 200), "4 chunks of 64 rows exceed")]
)
def test_grid_beyond_cudas_axis_limit_runs_torch(monkeypatch, shape, match):
    """B * H and the chunk count sit on a launch grid's y/z axes (at most 65535 programs on
    CUDA): beyond, the call goes to the torch backend with a warning instead of failing
    with the driver's raw "invalid argument" (the limit is lowered to 3 here)."""
    monkeypatch.setattr(T, "_MAX_GRID_YZ", 3)
    monkeypatch.setattr(T, "_WARNED", set())
    est = _estimator("prf", {})
    b, h, n = shape
    q, k, v = (torch.randn(b, h, n, 4, dtype=torch.float64) for _ in range(3))
    with pytest.warns(B.BackendWarning, match=match):
        out = ka.kernel_attention(q, k, v, est, causal=True, backend="triton")
    torch.testing.assert_close(out, ka.kernel_attention(q, k, v, est, causal=True, backend="torch"))


# ---------------------------------------------------------------- GPU (full sizes)
@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_fused_prf_matches_torch_backend(dtype, causal):
    est = _estimator("prf", {}, d=64, m=128).float().cuda()
    q, k, v = (torch.randn(2, 4, 2048, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    out = ka.kernel_attention(q, k, v, est, causal=causal, backend="triton")
    assert est.last_backend == "triton"
    ref = ka.kernel_attention(q.float(), k.float(), v.float(), est, causal=causal, backend="torch")
    # relative RMS: the causal first row's query gradient vanishes in exact arithmetic (one
    # key: the output is v_0 whatever q_0), so element-wise it is rounding noise alone
    (gq,) = torch.autograd.grad(out.float().square().sum(), q)
    (rq,) = torch.autograd.grad(ref.square().sum(), q)
    errs = [((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in ((out, ref), (gq, rq))]
    bound = (1e-5, 1e-4) if dtype == torch.float32 else (1e-2, 5e-2)
    assert errs[0] < bound[0] and errs[1] < bound[1], f"relative RMS output {errs[0]:.2e}, dq {errs[1]:.2e}"


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_step_and_non_finite_isolation():
    est = _estimator("elu", {}, d=64, m=64).float().cuda()
    q, k, v = (torch.randn(1, 2, 300, 64, device="cuda") for _ in range(3))
    k[0, :, 150] = float("nan")
    out = ka.kernel_attention(q, k, v, est, causal=True, backend="triton")
    assert bool(torch.isfinite(out[:, :, :150]).all()) and bool(torch.isnan(out[:, :, 150:]).all())
    st, outs = None, []
    for t in range(0, 300, 100):
        o, st = est.step(q[:, :, t : t + 100], k[:, :, t : t + 100], v[:, :, t : t + 100], st)
        outs.append(o)
    assert est.last_backend == "triton"
    torch.testing.assert_close(torch.cat(outs, 2), out, rtol=1e-4, atol=1e-4, equal_nan=True)
    assert bool(st.poisoned.all())
