"""The finite decoding step of ``sliding-window`` (``SlidingWindowAttention._step_finite`` on
``window.window_step_finite``): every position of a decode equals the guarded step's (rows
and states), the short path is taken once a position has left the window past the global
tokens, and whatever it must not handle (non-finite values, padding in the window, autograd,
a poisoned head) goes to the guarded step. CI cost: about 2 s."""

from __future__ import annotations

import pytest
import torch
from kernelattn_hybrid import estimator as estimator_module

import kernelattn_core as ka

B, H, N, D_HEAD, DV, W = 2, 3, 24, 8, 5, 4
PREFILL = 3


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per call of the short path: whether it returned (True) or declined (False)."""
    calls: list[bool] = []
    real = estimator_module.window_step_finite

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = real(*args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(estimator_module, "window_step_finite", counting)
    return calls


def _est(feature_map: str, global_tokens: int, dtype: torch.dtype) -> torch.nn.Module:
    est = ka.create(
        "sliding-window", window=W, feature_map=feature_map, num_features=16, global_tokens=global_tokens, seed=5
    )
    return est.to(dtype).eval()


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, N, D_HEAD, generator=g, dtype=dtype) for _ in range(2))
    return q, k, torch.randn(B, H, N, DV, generator=g, dtype=dtype)


def _decode(est, q, k, v, *, guarded: bool = False, mask: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
    if guarded:
        est._step_finite = lambda *args: None  # the instance attribute shadows the method
    try:
        with torch.no_grad():
            first = None if mask is None else mask[:, :PREFILL]
            out, state = est.step(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL], key_padding_mask=first)
            outs = [out]
            for t in range(PREFILL, N):
                one = slice(t, t + 1)
                pad = None if mask is None else mask[:, one]
                out, state = est.step(q[:, :, one], k[:, :, one], v[:, :, one], state, key_padding_mask=pad)
                outs.append(out)
    finally:
        if guarded:
            del est._step_finite
    return torch.cat(outs, 2), state


def _short(p: int, global_tokens: int) -> bool:
    """Whether the one-position step at position ``p`` takes the short path: past the
    global tokens, while the window fills (p < W), or once a position has left it (the
    features exist from p = W + 1) and the leaving one, p - W, is not global."""
    return global_tokens <= p < W or p >= W + max(1, global_tokens)


def _expected(global_tokens: int, start: int = PREFILL, stop: int = N) -> list[bool]:
    """The short path's calls (declined ones included) for the steps ``start .. stop - 1``."""
    return [True for p in range(start, stop) if _short(p, global_tokens)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("global_tokens", [0, 2])
@pytest.mark.parametrize("feature_map", ["hedgehog", "prf", "elu"])
def test_short_path_equals_the_guarded_step(feature_map: str, global_tokens: int, dtype: torch.dtype, taken) -> None:  # type: ignore[no-untyped-def]
    est = _est(feature_map, global_tokens, dtype)
    q, k, v = _inputs(dtype)
    ref, ref_state = _decode(est, q, k, v, guarded=True)
    assert taken == []
    got, state = _decode(est, q, k, v)
    assert taken == _expected(global_tokens) and len(taken) >= N - PREFILL - 2
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-6}
    torch.testing.assert_close(got, ref, **tol)
    for name in ("keys", "values", "valid", "sink_keys", "sink_values", "sink_valid", "poisoned"):
        torch.testing.assert_close(getattr(state, name), getattr(ref_state, name), **tol)
    f, rf = state.features, ref_state.features
    assert state.length == ref_state.length == N and f.length == rf.length
    scale = (f.m - rf.m).exp()[..., None] if rf.m is not None else 1.0  # the same sums at another stabiliser
    torch.testing.assert_close(f.kv * scale, rf.kv, **tol)
    with torch.no_grad():
        full = est(q, k, v, causal=True)
    torch.testing.assert_close(got, full, **tol)


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_non_finite_inputs_go_to_the_guarded_step(where: str, taken: list[bool]) -> None:
    est = _est("hedgehog", 0, torch.float64)
    q, k, v = _inputs(torch.float64, seed=1)
    t = 12
    {"q": q, "k": k, "v": v}[where][1, 2, t, 0] = float("nan")
    ref, ref_state = _decode(est, q, k, v, guarded=True)
    got, state = _decode(est, q, k, v)
    assert torch.equal(got.isnan(), ref.isnan()) and bool(got.isnan().any())
    torch.testing.assert_close(got[~ref.isnan()], ref[~ref.isnan()], rtol=1e-12, atol=1e-12)
    assert torch.equal(state.poisoned, ref_state.poisoned)
    before = _expected(0, stop=t)
    if where == "q":  # its own row only; later steps go short again
        assert taken == [*before, False, *_expected(0, start=t + 1)]
    else:  # the head is poisoned: every later step is guarded (and declines the short path)
        assert taken == before + [False] * (N - t)


def test_padding_in_the_window_and_autograd_take_the_guarded_step(taken: list[bool]) -> None:
    est = _est("hedgehog", 0, torch.float64)
    q, k, v = _inputs(torch.float64, seed=2)
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[0, 1] = True  # padded in the prefill: its slot is invalid until it leaves the window
    ref, _ = _decode(est, q, k, v, guarded=True, mask=mask)
    taken.clear()
    # the mask only for the prefill: the steps pass none, so the invalid slot itself must decline
    with torch.no_grad():
        _, state = est.step(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL], key_padding_mask=mask[:, :PREFILL])
        rows = []
        for t in range(PREFILL, N):
            out, state = est.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
            rows.append(out)
    got = torch.cat(rows, 2)
    torch.testing.assert_close(got, ref[:, :, PREFILL:], rtol=1e-12, atol=1e-12)
    # while the window fills the padded slot is masked (short path); p = W + 1 finds it still invalid as
    # it leaves: declined; then valid again
    assert taken == [*_expected(0, stop=W + 1), False, *_expected(0, start=W + 2)]
    taken.clear()
    with torch.enable_grad():
        est.step(q[:, :, N - 1 :], k[:, :, N - 1 :], v[:, :, N - 1 :], state)
    assert taken == []


def test_an_invalid_slot_declines(taken: list[bool]) -> None:
    est = _est("hedgehog", 0, torch.float64)
    q, k, v = _inputs(torch.float64, seed=3)
    with torch.no_grad():
        _, state = est.step(q[:, :, :10], k[:, :, :10], v[:, :, :10])
        state.valid = state.valid.clone()
        state.valid[1, 0, 2] = False  # as a padded position would leave it
        out, _ = est.step(q[:, :, 10:11], k[:, :, 10:11], v[:, :, 10:11], state)
        assert taken == [False]
        est._step_finite = lambda *args: None
        ref, _ = est.step(q[:, :, 10:11], k[:, :, 10:11], v[:, :, 10:11], state)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # the slot's key counts where it is valid: the rows differ from the unmodified state's
        del est._step_finite
        _, clean = est.step(q[:, :, :10], k[:, :, :10], v[:, :, :10])
        other, _ = est.step(q[:, :, 10:11], k[:, :, 10:11], v[:, :, 10:11], clean)
    assert not torch.allclose(other[1, 0], out[1, 0])


def test_a_padded_global_token_declines(taken: list[bool]) -> None:
    est = _est("hedgehog", 2, torch.float64)
    q, k, v = _inputs(torch.float64, seed=4)
    mask = torch.zeros(B, 10, dtype=torch.bool)
    mask[0, 1] = True  # a padded global token (a hole: not leading padding, which moves the globals): never attended
    with torch.no_grad():
        _, state = est.step(q[:, :, :10], k[:, :, :10], v[:, :, :10], key_padding_mask=mask)
        assert not bool(state.sink_valid[0].all())
        out, _ = est.step(q[:, :, 10:11], k[:, :, 10:11], v[:, :, 10:11], state)
        assert taken == [False]
        est._step_finite = lambda *args: None
        ref, _ = est.step(q[:, :, 10:11], k[:, :, 10:11], v[:, :, 10:11], state)
        del est._step_finite
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_a_head_poisoned_while_the_window_fills_stays_guarded(taken: list[bool]) -> None:
    est = ka.create("sliding-window", window=16, feature_map="hedgehog", num_features=16, seed=5)
    est = est.to(torch.float64).eval()
    q, k, v = _inputs(torch.float64, seed=5)
    v[0, 1, 6, 2] = float("nan")  # p = 6 < window: the ring buffer is still filling
    ref, ref_state = _decode(est, q, k, v, guarded=True)
    got, state = _decode(est, q, k, v)
    assert torch.equal(got.isnan(), ref.isnan()) and bool(got[0, 1, 6:].isnan().all())
    torch.testing.assert_close(got[~ref.isnan()], ref[~ref.isnan()], rtol=1e-12, atol=1e-12)
    assert torch.equal(state.poisoned, ref_state.poisoned)
    # p = 3..5 short; from 6 on the NaN, then the poisoned head, declines (p = 16 = window, the first
    # position to leave, is not offered: no feature state yet)
    assert taken == [True] * 3 + [False] * (N - 6 - 1)


def test_flags_seen_clean_are_checked_again_after_an_in_place_change(taken: list[bool]) -> None:
    """The short path checks the state's flags (valid, poisoned, ...) once and skips the check
    while later states hand the same, unmodified tensors on; a flag set in place is seen."""
    est = _est("hedgehog", 0, torch.float64)
    q, k, v = _inputs(torch.float64, seed=6)
    with torch.no_grad():
        _, state = est.step(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL])
        for t in range(PREFILL, 12):
            _, state = est.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        assert taken[-3:] == [True] * 3 and est._clean_flags[0][1] is state.poisoned
        state.poisoned[1, 0] = True  # in place: the same tensor, a new version
        out, _ = est.step(q[:, :, 12:13], k[:, :, 12:13], v[:, :, 12:13], state)
        assert taken[-1] is False
        est._step_finite = lambda *args: None
        ref, _ = est.step(q[:, :, 12:13], k[:, :, 12:13], v[:, :, 12:13], state)
        del est._step_finite
    assert bool(out[1, 0].isnan().all()) and not bool(out[0].isnan().any())
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_a_leaving_key_above_the_stabiliser_raises_it(monkeypatch: pytest.MonkeyPatch, taken: list[bool]) -> None:
    """A key whose features exceed the feature state's stabiliser when it leaves the window
    redoes the short step with the stabiliser raised (absorb_one_finite); other leaving keys
    are added at the stabiliser as it is (no rescaling of the sums)."""
    from kernelattn_hybrid import window as window_module

    raised: list[int] = []
    real = window_module.absorb_one_finite

    def counting(state, phi_k, v, *, log_space):  # type: ignore[no-untyped-def]
        raised.append(state.length)
        return real(state, phi_k, v, log_space=log_space)

    monkeypatch.setattr(window_module, "absorb_one_finite", counting)
    est = _est("hedgehog", 0, torch.float64)
    q, k, v = _inputs(torch.float64, seed=7)
    _decode(est, q, k, v)
    plain = set(raised)  # absorb_one_finite gets the features of the positions before the leaving one
    assert 12 not in plain
    k[:, :, 12] *= 4.0  # its log-features (+-(w.k + b)) reach far above every other key's
    ref, ref_state = _decode(est, q, k, v, guarded=True)
    raised.clear()
    taken.clear()
    got, state = _decode(est, q, k, v)
    assert all(taken) and len(taken) == len(_expected(0))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(state.features.m, ref_state.features.m)
    big = set(raised) - plain
    assert big == {12}  # the large key raised the stabiliser when it left the window ...
    assert not [n for n in raised if n > min(big)]  # ... and no later key reached it again
    assert len(raised) < len(taken)  # the others were added at the stabiliser as it was


def test_a_mask_that_pads_nothing_at_a_step_takes_the_short_path(taken: list[bool]) -> None:
    """Batched generation passes a padding mask at every step; where it pads none of the new
    positions the short path runs (equal to the guarded step), and a step that pads a key
    is the guarded step's."""
    est = _est("hedgehog", 2, torch.float64)
    q, k, v = _inputs(torch.float64, seed=8)
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[0, :2] = True  # a left-padded row (its global tokens start at 2)
    mask[1, 15] = True  # a hole while decoding: that step is guarded
    ref, ref_state = _decode(est, q, k, v, guarded=True, mask=mask)
    taken.clear()
    got, state = _decode(est, q, k, v, mask=mask)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for name in ("keys", "values", "valid", "poisoned"):
        torch.testing.assert_close(getattr(state, name), getattr(ref_state, name), rtol=1e-12, atol=1e-12)
    # offered at p = 3 and from p = 6 (W + g), except p = 15 (it pads a key): declined at 3 (row 0's
    # global token) and 6, 7 (row 0's global tokens 2, 3 leave the window), short at 8-14, declined at
    # 16-19 (the hole's invalid slot is in the window), short again from 20
    assert taken == [False] * 3 + [True] * 7 + [False] * 4 + [True] * 4
