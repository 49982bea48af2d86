"""RFA-Gate: the chunked causal form against the per-position recurrence, on outputs and
gradients; padding and future positions never reach an output."""

from __future__ import annotations

import pytest
import torch
from kernelattn_fourier.gate import Gate, gated_attention, gated_attention_naive, gated_sums


def _inputs(b: int = 2, h: int = 2, n: int = 11, d: int = 6, dv: int = 3, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    phi_q = torch.rand(b, h, n, d, generator=g, dtype=torch.float64) + 0.1  # positive, as PRF features
    phi_k = torch.rand(b, h, n, d, generator=g, dtype=torch.float64) + 0.1
    v = torch.randn(b, h, n, dv, generator=g, dtype=torch.float64)
    log_g = torch.nn.functional.logsigmoid(torch.randn(b, h, n, generator=g, dtype=torch.float64))
    return phi_q, phi_k, v, log_g


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 64])
def test_chunked_equals_the_recurrence(chunk_size: int) -> None:
    phi_q, phi_k, v, log_g = _inputs()
    fast = gated_attention(phi_q, phi_k, v, log_g, chunk_size=chunk_size)
    ref = gated_attention_naive(phi_q, phi_k, v, log_g)
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)


def test_gradients_match_the_recurrence_and_gradcheck() -> None:
    args = [t.requires_grad_() for t in _inputs(b=1, h=1, n=7, d=3, dv=2)]
    fast = gated_attention(*args, chunk_size=3)
    grads_fast = torch.autograd.grad(fast.square().sum(), args)
    ref = gated_attention_naive(*args)
    grads_ref = torch.autograd.grad(ref.square().sum(), args)
    for a, b in zip(grads_fast, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *x: gated_attention(*x, chunk_size=3), args)


def test_a_closed_gate_forgets_everything() -> None:
    """With g -> 0 there is no memory: the output at t is v_t exactly (only the current token survives)."""
    phi_q, phi_k, v, _ = _inputs()
    log_g = torch.full(v.shape[:-1], -60.0, dtype=torch.float64)  # g = e^-60
    out = gated_attention(phi_q, phi_k, v, log_g, chunk_size=4)
    torch.testing.assert_close(out, v, rtol=1e-12, atol=1e-12)


def test_future_and_padded_positions_never_reach_an_output() -> None:
    phi_q, phi_k, v, log_g = _inputs(n=9)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, 4] = True
    base = gated_attention(phi_q, phi_k, v, log_g, key_padding_mask=mask, chunk_size=4)
    v2, k2, g2 = v.clone(), phi_k.clone(), log_g.clone()
    v2[0, :, 4], k2[0, :, 4] = float("nan"), float("nan")  # padded: any value, NaN included
    g2[0, :, 4] = float("nan")
    v2[:, :, 8] = 1e6  # the future of every position but the last
    out = gated_attention(phi_q, k2, v2, g2, key_padding_mask=mask, chunk_size=4)
    torch.testing.assert_close(out[..., :8, :], base[..., :8, :])
    ref = gated_attention_naive(phi_q, phi_k, v, log_g, key_padding_mask=mask)
    torch.testing.assert_close(base, ref, rtol=1e-12, atol=1e-12)


def test_gate_module_shapes_and_training() -> None:
    gate = Gate(head_dim=6, num_heads=2)
    k = torch.randn(2, 2, 5, 6)
    log_g = gate(k)
    assert log_g.shape == (2, 2, 5) and bool((log_g < 0).all())
    phi_q, phi_k, v, _ = (t.float() for t in _inputs(n=5))
    gated_attention(phi_q, phi_k, v, log_g).sum().backward()
    assert gate.weight.grad is not None and gate.bias.grad is not None


# --------------------------------------------------------------------------- the registered estimator
def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm() / b.norm().clamp_min(1e-300)).detach())


def _gated_estimator(**options):  # type: ignore[no-untyped-def]
    """``rfa-gate`` in float64 with a gate that varies by position (random weight)."""
    import kernelattn_core as ka

    options = {"num_features": 8, "num_heads": 2, "head_dim": 6, "seed": 3, "init_gate_bias": 0.5, **options}
    est = ka.create("rfa-gate", **options).double()
    with torch.no_grad():
        est.gate.weight.copy_(torch.randn(est.gate.weight.shape, generator=torch.Generator().manual_seed(9)))
    return est


def _reference(est, q, k, v, mask):  # type: ignore[no-untyped-def]
    """The estimator written out: d^{-1/4} scaling, features, gate, the per-position
    recurrence (gated_sums_naive) and the signed-row division."""
    from kernelattn_fourier.gate import gated_sums_naive

    root = q.shape[-1] ** -0.25
    q, k = q * root, k * root
    if mask is not None:
        k = torch.where(mask[:, None, :, None], torch.zeros_like(k), k)
    num, den = gated_sums_naive(est.feature_map.query(q), est.feature_map.key(k), v, est.gate(k), key_padding_mask=mask)
    return est.normalizer.normalize(num, den)


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_estimator_equals_the_per_position_recurrence_on_outputs_and_gradients(chunk_size: int) -> None:
    est = _gated_estimator(chunk_size=chunk_size)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 13, s, generator=g, dtype=torch.float64, requires_grad=True) for s in (6, 6, 3))
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[0, 3], mask[1, 10:] = True, True
    fast = est(q, k, v, causal=True, key_padding_mask=mask)
    ref = _reference(est, q, k, v, mask)
    print("max abs difference", float((fast - ref).detach().abs().max()))
    assert _rel_rms(fast, ref) < 1e-12
    params = [q, k, v, est.gate.weight, est.gate.bias, est.feature_map.log_scale]
    w = torch.randn(fast.shape, generator=g, dtype=torch.float64)
    grads_fast = torch.autograd.grad((fast * w).sum(), params)
    grads_ref = torch.autograd.grad((ref * w).sum(), params)
    for name, a, b in zip(("q", "k", "v", "gate.weight", "gate.bias", "log_scale"), grads_fast, grads_ref):
        assert float(b.abs().max()) > 0, name  # the gradient reaches every input and parameter
        assert _rel_rms(a, b) < 1e-10, (name, float((a - b).abs().max()))


def test_estimator_gradcheck_float64() -> None:
    est = _gated_estimator(num_features=3, num_heads=None, head_dim=3, chunk_size=2)
    g = torch.Generator().manual_seed(2)
    args = [torch.randn(1, 1, 5, s, generator=g, dtype=torch.float64, requires_grad=True) for s in (3, 3, 2)]
    assert torch.autograd.gradcheck(lambda q, k, v: est(q, k, v, causal=True), args)


def test_estimator_refuses_non_causal_mode_naming_causal() -> None:
    from kernelattn_core.toolkit import InputError

    est = _gated_estimator()
    q = torch.randn(1, 2, 4, 6, dtype=torch.float64)
    for args in ((q, q, q[..., :3]), (q[:0], q[:0], q[:0, ..., :3])):  # empty shapes too
        with pytest.raises(InputError, match="causal: rfa-gate is causal only"):
            est(*args)
    assert est.supports_noncausal is False and est.supports_causal is True


def test_an_open_gate_is_causal_rfa() -> None:
    """g -> 1 everywhere: the constant 1 - g cancels in the ratio and rfa-gate is causal
    ``rfa`` with the same draws (computed by the core engine, an independent path)."""
    import kernelattn_core as ka

    gated = ka.create("rfa-gate", num_features=16, seed=5, init_gate_bias=30.0).double()  # 1 - g = 9e-14
    plain = ka.create("rfa", num_features=16, seed=5).double()
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 70, s, generator=g, dtype=torch.float64) for s in (8, 8, 3))
    out = gated(q, k, v, causal=True)
    ref = plain(q, k, v, causal=True)
    assert _rel_rms(out, ref) < 1e-9
    closed = ka.create("rfa-gate", num_features=16, seed=5, init_gate_bias=-3.0).double()
    assert _rel_rms(closed(q, k, v, causal=True), ref) > 0.1  # the gate changes the output


def test_a_closed_gate_returns_the_current_value() -> None:
    """g -> 0: only the current token survives; with q = k the features' inner product is
    1 (sin^2 + cos^2), so the output is v_t exactly (row division)."""
    import kernelattn_core as ka

    est = ka.create("rfa-gate", num_features=16, seed=5, init_gate_bias=-60.0, normalizer="row").double()
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 9, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(est(q, q, v, causal=True), v, rtol=1e-10, atol=1e-12)


def test_non_finite_later_positions_poison_only_later_rows() -> None:
    """A NaN value at position 5 reaches rows >= 5 (as the recurrence gives) and no earlier row,
    even inside one chunk where a 0 * NaN product would leak it."""
    from kernelattn_fourier.gate import gated_sums, gated_sums_naive

    phi_q, phi_k, v, log_g = _inputs(n=9)
    base = gated_sums(phi_q, phi_k, v, log_g, chunk_size=64)
    v2 = v.clone()
    v2[0, 1, 5] = float("nan")
    num, _ = gated_sums(phi_q, phi_k, v2, log_g, chunk_size=64)
    torch.testing.assert_close(num[0, 1, :5], base[0][0, 1, :5], rtol=0, atol=0)
    assert bool(num[0, 1, 5:].isnan().all()) and bool(torch.isfinite(num[1]).all() and torch.isfinite(num[0, 0]).all())
    ref_num, _ = gated_sums_naive(phi_q, phi_k, v2, log_g)
    assert torch.equal(ref_num.isnan(), num.isnan())


def test_non_finite_query_spoils_its_row_and_overflowing_sums_spoil_nothing() -> None:
    """The one-reduction finiteness test: an infinite query feature makes its own row NaN and
    no other; finite gates whose *sum* overflows (-1e308 twice in float64) send the call to
    the row scan, which finds nothing to poison (negative control for the shortcut)."""
    from kernelattn_fourier.gate import gated_sums_naive

    phi_q, phi_k, v, log_g = _inputs(n=9)
    base_num, _ = gated_sums(phi_q, phi_k, v, log_g, chunk_size=4)
    q2 = phi_q.clone()
    q2[1, 0, 3, 2] = float("inf")
    num, _ = gated_sums(q2, phi_k, v, log_g, chunk_size=4)
    spoiled = num.isnan().any(-1)
    assert bool(spoiled[1, 0, 3]) and int(spoiled.sum()) == 1
    lg = log_g.clone()  # finite gates (g = e^-1e308 = 0 exactly: the state is forgotten) whose sum is not
    lg[0, 0, 1], lg[0, 0, 6] = -1e308, -1e308  # in different chunks of 4
    assert not bool(torch.isfinite(lg.sum()))
    num, den = gated_sums(phi_q, phi_k, v, lg, chunk_size=4)
    ref_num, ref_den = gated_sums_naive(phi_q, phi_k, v, lg)
    assert bool(torch.isfinite(num).all()) and bool(torch.isfinite(den).all())
    torch.testing.assert_close(num, ref_num)
    torch.testing.assert_close(den, ref_den)
    torch.testing.assert_close(num[1], base_num[1], rtol=0, atol=0)


def _graph_size(n: int) -> int:
    phi_q, phi_k, v, log_g = (t.requires_grad_() for t in _inputs(b=1, h=1, n=n, d=4, dv=2))
    num, _ = gated_sums(phi_q, phi_k, v, log_g, chunk_size=16)
    seen, todo = set(), [num.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo += [f for f, _ in node.next_functions]
    return len(seen)


def test_the_fast_path_records_no_loop_at_all() -> None:
    """The autograd graph has the same size for 4 and 64 chunks: every chunk is in one
    batched product and the scan over chunks has its own backward (a recorded loop of
    slices would give every slice a full-size gradient: quadratic training)."""
    assert _graph_size(64) == _graph_size(1024) < 100


def test_the_gate_decay_across_many_chunks_matches_the_recurrence_on_gradients() -> None:
    """The state scan over chunks (now the engine's causal recurrence, with the gate as
    its log-decay): 11 chunks of 2, with an incoming state; the gradients of the
    features, the values, the gate and the incoming state against the per-position loop."""
    from kernelattn_fourier.gate import GateState, gated_sums_state

    from kernelattn_core.toolkit import decayed_linear_attention_naive

    args = [t.requires_grad_() for t in _inputs(b=2, h=1, n=21, d=3, dv=2, seed=3)]
    g = torch.Generator().manual_seed(3)
    kv0 = torch.randn(2, 1, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 1, 21, 3, generator=g, dtype=torch.float64)
    num, den, state = gated_sums_state(*args, chunk_size=2, state=GateState(kv0, 5))
    loss = (num * w[..., :2]).sum() + (den * w[..., 2]).sum() + state.kv.square().sum()
    grads = torch.autograd.grad(loss, [*args, kv0])
    phi_q, phi_k, v, log_g = args
    fk = phi_k * (-torch.expm1(log_g)).unsqueeze(-1)  # (1 - g_t) phi(k_t)
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    out, s_final = decayed_linear_attention_naive(phi_q, fk, v1, log_g, s0=kv0)
    ref_loss = (out * w).sum() + s_final.square().sum()
    for a, b in zip(grads, torch.autograd.grad(ref_loss, [*args, kv0]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert state.length == 26


def test_a_non_finite_later_position_reaches_no_earlier_gradient() -> None:
    """NaN in a later key, value or gate (and inf in a padded one): the gradients of a loss on
    the earlier rows are those of the clean inputs, bit for bit, with the gate's included."""
    from kernelattn_fourier.gate import gated_sums

    clean = _inputs(n=10)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[1, 2] = True
    results = []
    for spoil in (False, True):
        phi_q, phi_k, v, log_g = (t.clone() for t in clean)
        if spoil:
            phi_k[0, 0, 7], v[1, 1, 6], log_g[0, 1, 8] = float("nan"), float("nan"), float("nan")
            phi_k[1, :, 2], log_g[1, :, 2] = float("inf"), float("inf")  # padded
        args = [t.requires_grad_() for t in (phi_q, phi_k, v, log_g)]
        num, den = gated_sums(*args, key_padding_mask=mask, chunk_size=4)
        (num[..., :6, :].sum() + den[..., :6].sum()).backward()
        results.append([num[..., :6, :].detach()] + [t.grad[..., :6] for t in args])
        if spoil:
            assert all(bool(torch.isfinite(t.grad).all()) for t in args)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_gate_refuses_another_head_count_naming_num_heads() -> None:
    from kernelattn_core.toolkit import InputError

    gate = Gate(head_dim=4, num_heads=2)
    with pytest.raises(InputError, match="num_heads"):
        gate(torch.randn(1, 3, 5, 4))
    with pytest.raises(InputError, match="head_dim"):
        gate(torch.randn(1, 2, 5, 6))


def test_bad_gate_options_are_refused_naming_the_argument() -> None:
    import kernelattn_core as ka
    from kernelattn_core.toolkit import InputError

    with pytest.raises(InputError, match="init_gate_bias"):
        ka.create("rfa-gate", init_gate_bias=float("nan"))
    with pytest.raises(InputError, match="num_heads"):
        ka.create("rfa-gate", num_heads=0)
    with pytest.raises(InputError, match="chunk_size"):
        ka.create("rfa-gate", chunk_size=0)


@pytest.mark.parametrize("pieces", [[1] * 13, [3, 1, 4, 5], [13]])
def test_step_equals_the_causal_call_on_outputs_and_gradients(pieces: list[int]) -> None:
    """Token by token, in uneven pieces, or at once (chunk 4, so pieces cross chunks),
    with padding inside a piece: the rows of one causal call; gradients through the
    carried state reach the earlier positions and the gate and scale parameters."""
    est = _gated_estimator(chunk_size=4)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 13, s, generator=g, dtype=torch.float64, requires_grad=True) for s in (6, 6, 3))
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[0, 5], mask[1, 9:] = True, True
    full = est(q, k, v, causal=True, key_padding_mask=mask)
    outs, state, start = [], None, 0
    for t in pieces:
        sl = slice(start, start + t)
        out, state = est.step(q[:, :, sl], k[:, :, sl], v[:, :, sl], state, key_padding_mask=mask[:, sl])
        outs.append(out)
        start += t
    stepped = torch.cat(outs, dim=2)
    assert state.length == 13
    torch.testing.assert_close(stepped, full, rtol=1e-11, atol=1e-12)
    params = [q, k, v, est.gate.weight, est.gate.bias, est.feature_map.log_scale]
    w = torch.randn(full.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((stepped * w).sum(), params), torch.autograd.grad((full * w).sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_step_carries_a_consumed_non_finite_value_to_later_calls_only() -> None:
    est = _gated_estimator(chunk_size=4)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 8, s, generator=g, dtype=torch.float64) for s in (6, 6, 3))
    v[0, 1, 3] = float("nan")
    first, state = est.step(q[:, :, :5], k[:, :, :5], v[:, :, :5])
    later, _ = est.step(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], state)
    assert bool(torch.isfinite(first[0, :, :3]).all()) and bool(torch.isfinite(first[0, 0]).all())
    assert bool(torch.isnan(first[0, 1, 3:]).all()) and bool(torch.isnan(later[0, 1]).all())
    assert bool(torch.isfinite(later[0, 0]).all())  # the other head never saw it


def test_step_refuses_a_foreign_state_naming_state() -> None:
    from kernelattn_core.toolkit import InputError

    est = _gated_estimator(chunk_size=4)
    q = torch.randn(1, 2, 3, 6, dtype=torch.float64)
    with pytest.raises(InputError, match="state"):
        est.step(q, q, q[..., :3], state=("not", "a", "state"))  # type: ignore[arg-type]
    _, state = est.step(q, q, q[..., :3])
    with pytest.raises(InputError, match="state"):
        est.step(q, q, q, state)  # dv changed: another state shape


def test_kernel_attention_decodes_rfa_gate_with_a_constant_size_state() -> None:
    from kernelattn_fourier.gate import GateState

    import kernelattn_core as ka

    torch.manual_seed(0)
    attn = ka.KernelAttention(
        12, 2, estimator="rfa-gate", num_features=8, seed=0, causal=True, batch_first=True
    ).double()
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    full, _ = attn(x)
    outs, state = [], None
    for t in range(7):
        out, state = attn.step(x[:, t : t + 1], state)
        assert isinstance(state, GateState) and state.kv.shape == (2, 2, 16, 7)  # D = 2m, dv + 1
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-11, atol=1e-12)


@pytest.fixture
def short_steps(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per call of rfa-gate's short decoding step: whether it returned (True) or declined."""
    from kernelattn_fourier import estimators as estimators_module

    calls: list[bool] = []
    real = estimators_module.gated_step_finite

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = real(*args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(estimators_module, "gated_step_finite", counting)
    return calls


def _decode_gated(est, q, k, v, mask=None, guarded=False):  # type: ignore[no-untyped-def]
    """A 4-position prefill, then one position per step (``guarded``: the short step off)."""
    if guarded:
        est._step_finite = lambda *args: None
    with torch.no_grad():
        cut = (lambda a, b: None) if mask is None else (lambda a, b: mask[:, a:b])
        out, state = est.step(q[:, :, :4], k[:, :, :4], v[:, :, :4], key_padding_mask=cut(0, 4))
        outs = [out]
        for t in range(4, q.shape[2]):
            out, state = est.step(
                q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, key_padding_mask=cut(t, t + 1)
            )
            outs.append(out)
    if guarded:
        del est._step_finite
    return torch.cat(outs, 2), state


def test_decoding_one_position_takes_the_short_step(short_steps: list[bool]) -> None:
    """A one-position step (no autograd, nothing padded) runs gated_step_finite, about fifteen
    operations instead of the chunked scan: the guarded step's rows and state (and the
    causal call's rows); a padded position, a non-finite value and what follows a poisoned
    head take the guarded step."""
    est = _gated_estimator(chunk_size=4).eval()
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 2, 14, s, generator=g, dtype=torch.float64) for s in (6, 6, 3))
    ref, ref_state = _decode_gated(est, q, k, v, guarded=True)
    assert short_steps == []
    got, state = _decode_gated(est, q, k, v)
    assert short_steps == [True] * 10
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state.kv, ref_state.kv, rtol=1e-12, atol=1e-12)
    assert state.length == ref_state.length == 14 and state.owner == ref_state.owner
    with torch.no_grad():
        torch.testing.assert_close(got, est(q, k, v, causal=True), rtol=1e-11, atol=1e-12)
    # a padded position is the guarded step's; a NaN key declines and poisons its head for good
    mask = torch.zeros(2, 14, dtype=torch.bool)
    mask[0, 7] = True
    k[1, 0, 10, 2] = float("nan")
    ref, ref_state = _decode_gated(est, q, k, v, mask=mask, guarded=True)
    short_steps.clear()
    got, state = _decode_gated(est, q, k, v, mask=mask)
    assert short_steps == [True] * 3 + [True] * 2 + [False]  # 4-6 short, 7 padded (not offered), 8-9, 10 declines
    assert torch.equal(got.isnan(), ref.isnan()) and bool(got[1, 0, 10:].isnan().all())
    torch.testing.assert_close(got[~ref.isnan()], ref[~ref.isnan()], rtol=1e-12, atol=1e-12)
    assert torch.equal(state.poisoned, ref_state.poisoned)
