"""The grouped forward (no autograd, long sequences): features and attention per group
of positions, against the one-shot torch path; non-finite values carried across groups
and across decoding calls."""

from __future__ import annotations

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.engine import torch_backend as tb
from kernelattn_core.engine.torch_backend import feature_attention_grouped, feature_attention_step, group_length

F64 = torch.float64
NAMES = ("prf", "elu", "rfa", "hcexp", "schoenbat", "trig-softmax", "rmf", "gmm-prf")


def _est(name: str) -> ka.AttentionEstimator:
    est = ka.create(name) if name == "elu" else ka.create(name, num_features=32, head_dim=8, seed=0)
    return est.double().eval()


def _qkv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, n, 8, generator=g, dtype=F64) for _ in range(3))  # type: ignore[return-value]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_grouped_equals_one_shot_with_padding(name: str, causal: bool) -> None:
    est = _est(name)
    if causal and not est.supports_causal:
        pytest.skip("non-causal estimator")
    q, k, v = _qkv(300)
    mask = torch.zeros(2, 300, dtype=torch.bool)
    mask[1, 170:] = True
    k[1, :, 250] = float("nan")  # padded: must not matter
    ref = est(q, k, v, causal=causal, key_padding_mask=mask)  # autograd on: one-shot path
    fm = est.feature_map
    s = est.scale or 8**-0.5
    qs, ks = q * s**0.5, k * s**0.5
    if hasattr(est, "_pre"):
        qs, ks = est._pre(qs, ks, mask, causal)
    for group in (64, 128, 320):  # several groups, a ragged last one, one group
        num, den = feature_attention_grouped(
            fm, qs, ks, v, causal=causal, key_padding_mask=mask, chunk_size=32, group=group
        )
        out = est.normalizer.post(est.normalizer.normalize(num, den))
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_no_grad_calls_take_the_grouped_path_and_agree(monkeypatch: pytest.MonkeyPatch, causal: bool) -> None:
    est = _est("prf")
    q, k, v = _qkv(300, seed=1)
    ref = est(q, k, v, causal=causal)
    calls = []
    real = tb.feature_attention_grouped

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs.get("group"))
        return real(*args, **kwargs, group=64)

    monkeypatch.setattr(tb, "feature_attention_grouped", spy)
    monkeypatch.setattr(tb, "GROUP_BYTES", 1024)
    with torch.no_grad():
        out = est(q, k, v, causal=causal)
    assert calls == [None]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    est(q, k, v, causal=causal)  # autograd on: the one-shot path, not grouped
    assert calls == [None]


@pytest.mark.parametrize("causal", [False, True])
def test_a_non_finite_key_reaches_exactly_the_rows_that_see_it_across_groups(causal: bool) -> None:
    est = _est("prf")
    q, k, v = _qkv(300, seed=2)
    k[0, 1, 100] = float("nan")
    v[1, 2, 200] = float("inf")
    fm = est.feature_map
    num, den = feature_attention_grouped(fm, q, k, v, causal=causal, key_padding_mask=None, group=64)
    bad = torch.isnan(num).any(-1) | torch.isnan(den) | torch.isinf(num).any(-1)
    expect = torch.zeros(2, 3, 300, dtype=torch.bool)
    if causal:  # every row from the key on, in that batch element and head only
        expect[0, 1, 100:] = True
        expect[1, 2, 200:] = True
    else:
        expect[0, 1] = True
        expect[1, 2] = True
    assert torch.equal(bad, expect)


def test_decoding_state_carries_a_consumed_non_finite_key() -> None:
    """A NaN key consumed by an earlier call poisons every later row, as in the one-call
    form (the state itself stays finite)."""
    g = torch.Generator().manual_seed(3)
    pq, pk = (torch.randn(1, 2, 10, 4, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(1, 2, 10, 3, generator=g, dtype=F64)
    pk[0, 0, 2] = float("nan")
    whole, _, _ = feature_attention_step(pq, pk, v, log_space=True, key_padding_mask=None, state=None)
    _, _, state = feature_attention_step(
        pq[:, :, :5], pk[:, :, :5], v[:, :, :5], log_space=True, key_padding_mask=None, state=None
    )
    assert state.poisoned is not None and state.poisoned.tolist() == [[True, False]]
    assert torch.isfinite(state.kv).all()
    later, _, _ = feature_attention_step(
        pq[:, :, 5:], pk[:, :, 5:], v[:, :, 5:], log_space=True, key_padding_mask=None, state=state
    )
    assert torch.isnan(later[0, 0]).all() and torch.isfinite(later[0, 1]).all()
    torch.testing.assert_close(later, whole[:, :, 5:], equal_nan=True)


def test_group_length_bounds_the_block_and_is_a_chunk_multiple() -> None:
    g = group_length(4, 128, 4, 64)
    assert g % 64 == 0 and 4 * 128 * 4 * g <= tb.GROUP_BYTES < 4 * 128 * 4 * (g + 64)
    assert group_length(10**6, 128, 8, 64) == 64  # at least one chunk
