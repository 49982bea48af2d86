"""The causal core with a per-position log-decay (``causal_linear_attention(..., log_decay)``):
outputs and gradients (``q, k, v, s0, log_decay``) against the position-by-position
reference :func:`~kernelattn_core.engine.naive.decayed_linear_attention_naive`, across
chunk and group boundaries, with and without the log-space stabiliser."""

from __future__ import annotations

import pytest
import torch

import kernelattn_core.engine.chunked as chunked
from kernelattn_core.engine.chunked import causal_linear_attention
from kernelattn_core.engine.naive import decayed_linear_attention_naive
from kernelattn_core.errors import InputError

B, H, D, DV = 2, 3, 5, 4


def _inputs(
    n: int, seed: int = 0, dtype: torch.dtype = torch.float64, stabilised: bool = False, b: int = B, h: int = H
) -> dict:
    """Positive key features (stated at ``m`` when ``stabilised``), signed values, decays
    in ``[-1.5, 0]`` with some exact zeros, a non-zero incoming state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.rand(b, h, n, D, generator=gen, dtype=dtype)
    k = torch.rand(b, h, n, D, generator=gen, dtype=dtype)
    v = torch.randn(b, h, n, DV, generator=gen, dtype=dtype)
    ld = -1.5 * torch.rand(b, h, n, generator=gen, dtype=dtype)
    ld[..., ::5] = 0.0  # no decay at some positions
    s0 = torch.randn(b, h, D, DV, generator=gen, dtype=dtype)
    m = m0 = None
    if stabilised:  # a non-decreasing stabiliser with flat stretches and jumps
        m = (3.0 * torch.randn(b, h, n, generator=gen, dtype=dtype)).cummax(-1).values
        m0 = m[..., :1] - 0.75
    return {"q": q, "k": k, "v": v, "log_decay": ld, "s0": s0, "m": m, "m0": m0}


def _grads(x: dict, fn, use_state: bool, seed: int = 1) -> tuple[torch.Tensor, ...]:  # type: ignore[no-untyped-def]
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "log_decay", "s0")}
    out, s_final = fn(leaves)
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
    if use_state:
        loss = loss + (s_final * torch.randn(s_final.shape, generator=gen, dtype=out.dtype)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)  # log_decay unused without decay
    return (out.detach(), s_final.detach(), *grads)


def _fast(x: dict, chunk: int):  # type: ignore[no-untyped-def]
    return lambda t: causal_linear_attention(t["q"], t["k"], t["v"], t["s0"], x["m"], x["m0"], chunk, t["log_decay"])


def _naive(x: dict):  # type: ignore[no-untyped-def]
    return lambda t: decayed_linear_attention_naive(
        t["q"], t["k"], t["v"], t["log_decay"], s0=t["s0"], m=x["m"], m0=x["m0"]
    )


NAMES = ("out", "s_final", "q", "k", "v", "log_decay", "s0")


@pytest.mark.parametrize("stabilised", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
@pytest.mark.parametrize("use_state", [False, True])
def test_outputs_and_gradients_match_the_position_loop(stabilised: bool, chunk: int, use_state: bool) -> None:
    x = _inputs(37, stabilised=stabilised)  # 37: a partial last chunk for every chunk size > 1
    fast, ref = _grads(x, _fast(x, chunk), use_state), _grads(x, _naive(x), use_state)
    for name, a, b in zip(NAMES, fast, ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10), (name, (a - b).abs().max().item())


def test_groups_carry_the_decayed_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of 8 positions (chunks of 4): the state and the log-decay gradient cross
    four group boundaries."""
    monkeypatch.setattr(chunked, "GROUP", 8)
    x = _inputs(37, seed=3, stabilised=True)
    fast, ref = _grads(x, _fast(x, 4), True), _grads(x, _naive(x), True)
    for name, a, b in zip(NAMES, fast, ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10), (name, (a - b).abs().max().item())


@pytest.mark.parametrize("stabilised", [False, True])
def test_gradcheck_float64(stabilised: bool) -> None:
    x = _inputs(7, seed=5, stabilised=stabilised, b=1, h=2)
    x["log_decay"] = x["log_decay"] - 0.1  # strictly negative: finite differences stay <= 0

    def fn(q, k, v, ld, s0):  # type: ignore[no-untyped-def]
        return causal_linear_attention(q, k, v, s0, x["m"], x["m0"], 3, ld)

    args = tuple(x[n].clone().requires_grad_() for n in ("q", "k", "v", "log_decay", "s0"))
    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("stabilised", [False, True])
def test_zero_decay_is_the_undecayed_core(stabilised: bool) -> None:
    """``log_decay = 0`` gives the core without a decay: bit for bit with a stabiliser (the
    same factors), to 1e-12 without one (the state scan then adds in another order)."""
    x = _inputs(29, seed=7, stabilised=stabilised)
    x["log_decay"] = torch.zeros_like(x["log_decay"])
    decayed = _grads(x, _fast(x, 4), True)
    plain = _grads(x, lambda t: causal_linear_attention(t["q"], t["k"], t["v"], t["s0"], x["m"], x["m0"], 4), True)
    for name, a, b in zip(NAMES, decayed, plain, strict=True):
        if name == "log_decay":
            continue  # no decay: no gradient to compare with
        if stabilised:
            assert torch.equal(a, b), name
        else:
            assert torch.allclose(a, b, rtol=0, atol=1e-12), (name, (a - b).abs().max().item())


def test_the_reference_tells_the_decay_convention_apart() -> None:
    """Negative control: decaying *after* the key is added (the previous position's decay)
    differs from the core by far more than the tolerance of the comparisons above."""
    x = _inputs(37, seed=9)
    out, _ = causal_linear_attention(x["q"], x["k"], x["v"], x["s0"], None, None, 8, x["log_decay"])
    shifted = torch.nn.functional.pad(x["log_decay"][..., 1:], (0, 1))  # lambda_{t+1} applied at t
    wrong, _ = decayed_linear_attention_naive(x["q"], x["k"], x["v"], shifted, s0=x["s0"])
    assert (out - wrong).abs().max() > 1e-2


def test_strong_decay_in_float32_stays_finite_and_exact() -> None:
    """Every factor is ``e^{<= 0}``: a decay of ``e^{-1e4}`` per position with large
    stabilisers overflows nothing, and forgets everything but the current key:
    :math:`o_t = (q_t^\\top k_t) v_t`."""
    x = _inputs(300, seed=11, dtype=torch.float32, stabilised=True)
    x["m"] = x["m"] * 30.0  # stabilisers up to ~300
    x["m0"] = x["m"][..., :1]
    ld = torch.full_like(x["log_decay"], -1e4)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v")]
    ld.requires_grad_()
    out, s_final = causal_linear_attention(*leaves, x["s0"], x["m"], x["m0"], 64, ld)
    own = (leaves[0] * leaves[1]).sum(-1, keepdim=True) * leaves[2]
    assert torch.allclose(out, own, rtol=1e-5, atol=1e-6)
    (out.sum() + s_final.sum()).backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (*leaves, ld))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_zero_gate_does_not_absorb_its_neighbours_decay(dtype: torch.dtype) -> None:
    """One position's log-decay far below the dtype's exponent range (a gate of exactly 0)
    inside a chunk of moderate ones: within-chunk cumulated exponents would absorb the
    neighbours' decays (-1e30 + -0.7 == -1e30, which loses a factor e^-0.7 per neighbour);
    the core raises it to a floor whose exponential is 0 as well, so outputs and gradients
    are the position loop's. The loop with the raw value is the reference (it multiplies by
    e^-1e30 = 0 directly)."""
    x = _inputs(20, seed=17, dtype=dtype, stabilised=True)
    x["log_decay"][0, 1, 5] = -1e30
    x["log_decay"][1, 0, 12] = -1e30
    fast, ref = _grads(x, _fast(x, 8), True), _grads(x, _naive(x), True)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for name, a, b in zip(NAMES, fast, ref, strict=True):
        assert torch.allclose(a, b, rtol=tol, atol=tol), (name, (a - b).abs().max().item())
    assert float(fast[NAMES.index("log_decay")][0, 1, 5]) == 0.0  # e^lambda = 0: no gradient


def test_moderate_decay_in_float32_matches_float64() -> None:
    x = _inputs(300, seed=13, dtype=torch.float32, stabilised=True)
    out32, _ = causal_linear_attention(x["q"], x["k"], x["v"], x["s0"], x["m"], x["m0"], 64, x["log_decay"])
    x64 = {n: (None if t is None else t.double()) for n, t in x.items()}
    out64, _ = causal_linear_attention(
        x64["q"], x64["k"], x64["v"], x64["s0"], x64["m"], x64["m0"], 64, x64["log_decay"]
    )
    assert torch.allclose(out32.double(), out64, rtol=1e-4, atol=1e-5)


def test_later_positions_change_neither_earlier_rows_nor_their_gradients() -> None:
    """Keys, values and decays after position 20 (huge keys and values, decays from 0 to
    -50) leave rows <= 20 and the gradients of a loss on them bit-identical."""
    x = _inputs(45, seed=15, dtype=torch.float32, stabilised=True)
    y = {n: (None if t is None else t.clone()) for n, t in x.items()}
    y["k"][..., 21:, :] = 1e18
    y["v"][..., 21:, :] = -1e18
    y["log_decay"][..., 21:] = torch.linspace(0.0, -50.0, 24)
    res = []
    for inp in (x, y):
        leaves = {n: inp[n].clone().requires_grad_() for n in ("q", "k", "v", "log_decay", "s0")}
        out, _ = causal_linear_attention(
            leaves["q"], leaves["k"], leaves["v"], leaves["s0"], inp["m"], inp["m0"], 8, leaves["log_decay"]
        )
        out[..., :21, :].sum().backward()
        res.append((out[..., :21, :].detach(), *(leaves[n].grad[..., :21] for n in ("q", "k", "v", "log_decay"))))
    for a, b in zip(*res, strict=True):
        assert bool(torch.isfinite(a).all())
        assert torch.equal(a, b)


def test_autograd_records_no_loop_over_positions_or_chunks() -> None:
    """The recorded graph has the same number of nodes at 64 and at 1024 positions."""

    def nodes(n: int) -> int:
        x = _inputs(n, dtype=torch.float32)
        leaves = [x[name].clone().requires_grad_() for name in ("q", "k", "v", "log_decay")]
        q, k, v, ld = leaves
        out, s_final = causal_linear_attention(q, k, v, x["s0"], None, None, 16, ld)
        seen, todo = set(), [out.grad_fn, s_final.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            todo.extend(f for f, _ in fn.next_functions)
        return len(seen)

    assert nodes(64) == nodes(1024)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (lambda ld: ld + 0.5, "<= 0"),
        (lambda ld: ld.index_fill(-1, torch.tensor([3]), float("nan")), "finite"),
        (lambda ld: ld.index_fill(-1, torch.tensor([3]), float("-inf")), "finite"),
        (lambda ld: ld[..., :-1], "shape"),
        (lambda ld: ld.long(), "floating-point"),
    ],
)
def test_bad_log_decay_is_named(bad, says: str) -> None:  # type: ignore[no-untyped-def]
    x = _inputs(9)
    with pytest.raises(InputError, match=rf"log_decay: .*{says}"):
        causal_linear_attention(x["q"], x["k"], x["v"], x["s0"], None, None, 4, bad(x["log_decay"]))


@pytest.mark.parametrize("stabilised", [False, True])
@pytest.mark.parametrize("decay", ["none", "zero", "random"])
def test_the_compile_form_equals_the_eager_core(stabilised: bool, decay: str) -> None:
    """``torch.compile`` runs ``_traced`` (no data-dependent branch, autograd's backward):
    the eager core's outputs, final state and gradients, to 1e-10."""
    x = _inputs(37, seed=17, stabilised=stabilised)
    if decay == "zero":
        x["log_decay"] = torch.zeros_like(x["log_decay"])

    def pick(t: dict) -> torch.Tensor | None:
        return None if decay == "none" else t["log_decay"]

    fast = _grads(
        x, lambda t: causal_linear_attention(t["q"], t["k"], t["v"], t["s0"], x["m"], x["m0"], 8, pick(t)), True
    )
    traced = _grads(x, lambda t: chunked._traced(t["q"], t["k"], t["v"], t["s0"], x["m"], x["m0"], pick(t), 8), True)
    for name, a, b in zip(NAMES, fast, traced, strict=True):
        if a is None or b is None:
            assert a is None and b is None and name == "log_decay"
            continue
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10), (name, (a - b).abs().max().item())
