"""The vectorised causal engine (``engine/chunked.py``): its own backward against autograd
through the quadratic reference, resumable state, and masked or non-finite values."""

from __future__ import annotations

import pytest
import torch

import kernelattn_core.engine.chunked as chunked
from kernelattn_core.engine.naive import feature_attention_naive
from kernelattn_core.engine.torch_backend import feature_attention_step, feature_attention_torch

from .conftest import qkv


@pytest.fixture
def small_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of 4 positions, so that short test sequences cross several groups."""
    monkeypatch.setattr(chunked, "GROUP", 4)


def _features(log_space: bool, n: int = 11, seed: int = 0) -> tuple[torch.Tensor, ...]:
    q, k, v = qkv(b=2, h=2, n=n, d=5, dv=3, seed=seed)
    lq, lk = q, 1.5 * k  # log-features, or positive plain features after exp
    return (lq, lk, v) if log_space else (lq.exp(), lk.exp(), v)


def _padding(n: int) -> torch.Tensor:
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[0, :3] = True  # the first rows of batch 0 see no key at all
    mask[1, 5] = True
    mask[1, -1] = True
    return mask


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    safe = torch.where(den == 0, torch.ones_like(den), den)
    return num / safe.unsqueeze(-1)


@pytest.mark.parametrize("log_space", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 4, 16])
def test_outputs_and_gradients_match_autograd_through_the_quadratic_reference(
    small_groups: None, log_space: bool, chunk: int
) -> None:
    phi_q, phi_k, v = _features(log_space)
    mask = _padding(11)
    weight = torch.linspace(-1, 2, 3, dtype=torch.float64)
    results = []
    for fast in (False, True):
        a, b, c = (t.clone().requires_grad_(True) for t in (phi_q, phi_k, v))
        if fast:
            num, den = feature_attention_torch(
                a, b, c, log_space=log_space, causal=True, key_padding_mask=mask, chunk_size=chunk
            )
        else:
            num, den = feature_attention_naive(a, b, c, log_space=log_space, causal=True, key_padding_mask=mask)
        out = _ratio(num, den)  # invariant to the engine's per-query stabiliser
        (out * weight).sum().backward()
        results.append((out, a.grad, b.grad, c.grad))
    for fast, ref in zip(*results):
        torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    assert (results[1][0][0, :, :3] == 0).all()  # rows with no allowed key


@pytest.mark.parametrize("log_space", [False, True])
def test_gradcheck_float64_with_padding_and_empty_rows(small_groups: None, log_space: bool) -> None:
    phi_q, phi_k, v = _features(log_space, n=9)
    mask = _padding(9)

    def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        num, den = feature_attention_torch(
            a, b, c, log_space=log_space, causal=True, key_padding_mask=mask, chunk_size=2
        )
        return _ratio(num, den)

    inputs = tuple(t.clone().requires_grad_(True) for t in (phi_q, phi_k, v))
    assert torch.autograd.gradcheck(fn, inputs)


def test_plain_numerator_and_denominator_gradcheck_signed_features(small_groups: None) -> None:
    """Signed plain features (trigonometric maps): num and den themselves, not only the ratio."""
    q, k, v = qkv(b=1, h=2, n=10, d=4, dv=2, seed=8)
    inputs = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda a, b, c: feature_attention_torch(
            a, b, c, log_space=False, causal=True, key_padding_mask=None, chunk_size=3
        ),
        inputs,
    )


@pytest.mark.parametrize("log_space", [False, True])
def test_state_is_differentiable_and_splitting_the_sequence_changes_nothing(
    small_groups: None, log_space: bool
) -> None:
    """Two calls chained by the state (decoding, sequence parallelism) give the outputs
    and the gradients of one call: gradients flow back through the state."""
    phi_q, phi_k, v = _features(log_space, n=13, seed=3)
    mask = _padding(13)
    weight = torch.linspace(-1, 2, 3, dtype=torch.float64)
    results = []
    for split in (None, 6):
        a, b, c = (t.clone().requires_grad_(True) for t in (phi_q, phi_k, v))
        if split is None:
            num, den, _ = feature_attention_step(
                a, b, c, log_space=log_space, key_padding_mask=mask, state=None, chunk_size=4
            )
            out = _ratio(num, den)
        else:
            parts, state = [], None
            for sl in (slice(0, split), slice(split, None)):
                num, den, state = feature_attention_step(
                    a[:, :, sl], b[:, :, sl], c[:, :, sl], log_space=log_space, key_padding_mask=mask[:, sl],
                    state=state, chunk_size=4,
                )  # fmt: skip
                parts.append(_ratio(num, den))
            out = torch.cat(parts, dim=2)
        (out * weight).sum().backward()
        results.append((out, a.grad, b.grad, c.grad))
    for split_result, whole in zip(*results):
        torch.testing.assert_close(split_result, whole, rtol=1e-10, atol=1e-12)


def test_huge_later_key_changes_neither_earlier_outputs_nor_their_gradients(small_groups: None) -> None:
    q, k, v = qkv(b=1, h=2, n=16, d=6, dv=3, seed=2, dtype=torch.float32)
    results = []
    for huge in (False, True):
        lk = k.clone()
        if huge:
            lk[:, :, 10] = 80.0  # e^80 overflows float32 unless the stabiliser is causal
        a, b, c = (t.clone().requires_grad_(True) for t in (q, lk, v))
        num, den = feature_attention_torch(a, b, c, log_space=True, causal=True, key_padding_mask=None, chunk_size=4)
        out = _ratio(num, den)
        assert torch.isfinite(out).all()
        out[:, :, :10].sum().backward()  # a loss on the rows before the huge key
        results.append((out[:, :, :10], a.grad[:, :, :10], b.grad[:, :, :10], c.grad[:, :, :10]))
    for before, after in zip(*results):
        assert torch.equal(before, after)


@pytest.mark.parametrize("log_space", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_padded_non_finite_keys_and_values_never_reach_outputs_or_gradients(
    log_space: bool, causal: bool, bad: float
) -> None:
    phi_q, phi_k, v = _features(log_space, n=10, seed=5)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, 6] = True
    mask[1, 8:] = True
    results = []
    for poisoned in (False, True):
        b_, c_ = phi_k.clone(), v.clone()
        if poisoned:
            b_[:, :, 6, 1] = bad  # padded key features
            c_[:, :, 6, 0] = bad  # padded values
            c_[1, :, 9] = bad
        a, b, c = (t.clone().requires_grad_(True) for t in (phi_q, b_, c_))
        num, den = feature_attention_torch(a, b, c, log_space=log_space, causal=causal, key_padding_mask=mask)
        out = _ratio(num, den)
        out.sum().backward()
        results.append((out, a.grad, b.grad, c.grad))
    for clean, poisoned in zip(*results):
        assert torch.isfinite(poisoned).all()
        torch.testing.assert_close(poisoned, clean, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("log_space", [False, True])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("position", [5, 13], ids=["same-chunk", "later-chunk"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_future_non_finite_value_never_changes_earlier_rows(
    log_space: bool, where: str, position: int, bad: float
) -> None:
    """Rows before a non-finite key or value keep their outputs and gradients bit for
    bit; rows at and after it (which legitimately see it) are not finite."""
    phi_q, phi_k, v = _features(log_space, n=16, seed=6)
    first = 4  # chunk of 8: position 5 shares the chunk of rows 4..7, position 13 is later
    results = []
    for poisoned in (False, True):
        b_, c_ = phi_k.clone(), v.clone()
        if poisoned:
            (b_ if where == "k" else c_)[:, :, position, 0] = bad
        a, b, c = (t.clone().requires_grad_(True) for t in (phi_q, b_, c_))
        num, den = feature_attention_torch(
            a, b, c, log_space=log_space, causal=True, key_padding_mask=None, chunk_size=8
        )
        out = _ratio(num, den)
        out[:, :, :position].sum().backward()  # a loss on the rows that cannot see it
        results.append((out, a.grad, b.grad, c.grad))
        if poisoned:
            assert not torch.isfinite(out[:, :, position:]).any()
    for clean, poisoned in zip(*results):
        assert torch.isfinite(poisoned[:, :, :position]).all()
        assert torch.equal(poisoned[:, :, :position], clean[:, :, :position])
        assert torch.equal(poisoned[:, :, first:position], clean[:, :, first:position])


def test_non_finite_query_only_affects_its_own_row() -> None:
    phi_q, phi_k, v = _features(True, n=12, seed=7)
    phi_q = phi_q.clone()
    phi_q[:, :, 4, 2] = float("nan")
    num, den = feature_attention_torch(phi_q, phi_k, v, log_space=True, causal=True, key_padding_mask=None)
    out = _ratio(num, den)
    ref = _ratio(*feature_attention_naive(phi_q, phi_k, v, log_space=True, causal=True, key_padding_mask=None))
    rows = torch.ones(12, dtype=torch.bool)
    rows[4] = False
    assert not torch.isfinite(out[:, :, 4]).any()
    torch.testing.assert_close(out[:, :, rows], ref[:, :, rows], rtol=1e-10, atol=1e-12)


def _training_bytes(n: int, d_feat: int = 32, dv: int = 16) -> tuple[int, int]:
    """Peak and total bytes of the tensors that forward + backward allocate."""
    from kernelattn_core.cli.measure import _PeakTensorMemory

    class Count(_PeakTensorMemory):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            before = self.current
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.total += max(0, self.current - before)
            return out

    g = torch.Generator().manual_seed(0)
    lq, lk = (torch.randn(1, 2, n, d_feat, generator=g).requires_grad_(True) for _ in range(2))
    v = torch.randn(1, 2, n, dv, generator=g).requires_grad_(True)
    mode = Count()
    with mode:
        num, den = feature_attention_torch(lq, lk, v, log_space=True, causal=True, key_padding_mask=None)
        (num.sum() + den.sum()).backward()
    return mode.peak, mode.total


def test_training_memory_and_work_are_linear_in_sequence_length() -> None:
    """Forward + backward allocate in total, and hold at peak, an amount linear in N: the
    old chunk loop's backward allocated a full-size gradient per chunk (O(N^2 / C))."""
    (peak1, total1), (peak2, total2) = _training_bytes(8192), _training_bytes(16384)
    assert total2 < 2.3 * total1  # quadratic work would give 4x
    per_token = (peak2 - peak1) / 8192
    # gradients of the inputs, key features and their gradient, values with the ones
    # column, outputs: a few times 2 heads * (2 D + dv) floats per token
    assert per_token < 12 * 2 * (2 * 32 + 16 + 1) * 4


@pytest.mark.parametrize("n", [11, 16])
def test_forward_tape_gives_the_recomputed_gradients_bit_for_bit(small_groups: None, n: int) -> None:
    """``causal_linear_attention_forward(tape=[])`` keeps each group's blocks (states,
    gate, gated products); the backward pass then reuses them. Same gradients bit for bit,
    over several groups, with a moving stabiliser and padding to the chunk."""
    lq, lk, v = _features(True, n=n)
    m = lk.amax(-1).cummax(-1).values  # a non-decreasing stabiliser
    fk = (lk - m.unsqueeze(-1)).exp()
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    s0 = torch.zeros(2, 2, lq.shape[-1], 4, dtype=torch.float64)
    m0 = torch.full((2, 2, 1), -1e30, dtype=torch.float64)
    fq = (lq - lq.amax(-1, keepdim=True)).exp()
    o_bar = torch.randn(2, 2, n, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    tape: list = []
    out_t, s_t = chunked.causal_linear_attention_forward(fq, fk, v1, s0, m, m0, 3, tape=tape)
    out, s_final = chunked.causal_linear_attention_forward(fq, fk, v1, s0, m, m0, 3)
    assert len(tape) == len(chunked._groups(n + (-n % 3), 3)) > 1
    assert torch.equal(out_t, out) and torch.equal(s_t, s_final)
    with_tape = chunked.causal_linear_attention_backward(fq, fk, v1, s0, m, m0, 3, o_bar, None, tape=tape)
    without = chunked.causal_linear_attention_backward(fq, fk, v1, s0, m, m0, 3, o_bar, None)
    for a, b in zip(with_tape, without):
        assert torch.equal(a, b)
    # negative control: the backward reads the tape (a changed product changes a gradient)
    tape[-1].a.mul_(2.0)
    changed = chunked.causal_linear_attention_backward(fq, fk, v1, s0, m, m0, 3, o_bar, None, tape=tape)
    assert not torch.equal(changed[2], without[2])


def test_forward_tape_refuses_a_decay_and_a_foreign_tape() -> None:
    fq, fk, v = _features(False)
    s0 = torch.zeros(2, 2, 5, 3, dtype=torch.float64)
    with pytest.raises(chunked.InputError, match="tape"):
        chunked.causal_linear_attention_forward(fq, fk, v, s0, None, None, 4, torch.zeros(2, 2, 11), tape=[])
    with pytest.raises(chunked.InputError, match="tape: expected the 1 blocks"):
        chunked.causal_linear_attention_backward(fq, fk, v, s0, None, None, 4, torch.ones_like(v), None, tape=[1, 2])


def test_exp_kept_is_masked_exp_with_the_fast_path() -> None:
    """:func:`~kernelattn_core.engine.chunked.exp_kept` equals ``masked_fill(-inf).exp()``
    in outputs and gradients bit for bit for kept arguments from the dtype's edge up
    (positive, ``inf`` and NaN included: nothing non-finite is hidden), is exactly 0 in
    output and gradient where masked whatever the argument holds, raises an argument
    below the edge to it (a gradient of that size, not of 0), and has second derivatives."""
    from kernelattn_core.engine.chunked import exp_kept

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 16, generator=g, dtype=torch.float64) * 3
    keep = torch.rand(16, 16, generator=g) > 0.5
    x[0, 0, :3] = torch.tensor([float("inf"), float("nan"), 5.0])  # kept or not, as drawn
    x[1][~keep] = float("nan")  # masked NaN: never seen
    keep[0, :3] = True
    weight = torch.randn(x.shape, generator=g, dtype=torch.float64)

    def run(fn):  # type: ignore[no-untyped-def]
        leaf = x.clone().requires_grad_(True)
        out = fn(leaf * 1.0)
        (out.nan_to_num(0.0, 0.0, 0.0) * weight).sum().backward()
        return out.detach(), leaf.grad

    out, grad = run(lambda t: exp_kept(t, keep))
    ref_out, ref_grad = run(lambda t: t.masked_fill(~keep, float("-inf")).exp())
    assert torch.equal(out.nan_to_num(7.0), ref_out.nan_to_num(7.0))
    assert torch.equal(grad.nan_to_num(7.0), ref_grad.nan_to_num(7.0))
    assert out[0, 0, 0] == float("inf") and out[0, 0, 1].isnan()
    assert (out[1][~keep] == 0).all() and (grad[1][~keep] == 0).all()
    edge = torch.finfo(torch.float64).tiny
    low = torch.tensor([-800.0, -1.0], dtype=torch.float64, requires_grad=True)
    y = exp_kept(low * 1.0)
    y.sum().backward()
    assert y[0].item() >= edge and low.grad[0].item() >= edge  # raised to the edge, not 0
    small = (torch.rand(2, 5, 5, generator=g, dtype=torch.float64) - 2.0).requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda t: exp_kept(t * 1.0, keep[:5, :5]), (small,))
