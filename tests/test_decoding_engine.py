"""The engine's decoding helpers: the one-position recurrence of feature_attention_step
(taken when decoding without autograd) and absorb_keys (keys into a state without
queries), each against the chunked causal core they shortcut. CI cost: about 2 s."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernelattn_core.engine.torch_backend import CausalState, absorb_keys, feature_attention_step

F64 = torch.float64


def _features(n: int, log_space: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pq, pk = (torch.randn(2, 3, n, 6, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(2, 3, n, 4, generator=g, dtype=F64)
    if not log_space:
        pq, pk = pq.exp(), pk.exp()
    return pq, pk, v


@pytest.mark.parametrize(("log_space", "padded", "poisoned"), list(itertools.product([True, False], repeat=3)))
def test_one_position_recurrence_equals_the_chunked_core(log_space: bool, padded: bool, poisoned: bool) -> None:
    n = 12
    pq, pk, v = _features(n, log_space, seed=1)
    mask = torch.zeros(2, n, dtype=torch.bool)
    if padded:
        mask[0, :3] = True  # left padding
        mask[1, 7] = True
    if poisoned:
        pk[0, 1, 5, 2] = float("nan")
        pq[1, 2, 9, 0] = float("inf")
        v[1, 0, 7, 1] = float("nan")  # at a padded position when padded
    kw = {"log_space": log_space, "key_padding_mask": mask if padded else None}
    with torch.enable_grad():  # autograd on: the chunked core, one call
        num_ref, den_ref, state_ref = feature_attention_step(pq, pk, v, state=None, **kw)
    num, den, state = feature_attention_step(pq[:, :, :2], pk[:, :, :2], v[:, :, :2], state=None, **_cut(kw, 0, 2))
    nums, dens = [num], [den]
    with torch.no_grad():
        for t in range(2, n):  # the one-position recurrence
            num, den, state = feature_attention_step(
                pq[:, :, t : t + 1], pk[:, :, t : t + 1], v[:, :, t : t + 1], state=state, **_cut(kw, t, t + 1)
            )
            nums.append(num)
            dens.append(den)
    got_num, got_den = torch.cat(nums, 2), torch.cat(dens, 2)
    ratio_ref, ratio = num_ref / den_ref.unsqueeze(-1), got_num / got_den.unsqueeze(-1)  # stabilisers cancel
    assert torch.equal(ratio.isnan(), ratio_ref.isnan())
    keep = ~ratio_ref.isnan()
    torch.testing.assert_close(ratio[keep], ratio_ref[keep], rtol=1e-12, atol=1e-12)
    assert state.length == n
    assert (state.poisoned is not None) == poisoned
    torch.testing.assert_close(_ratio_of(state), _ratio_of(state_ref), rtol=1e-12, atol=1e-12, equal_nan=True)


def _cut(kw: dict, a: int, b: int) -> dict:
    mask = kw["key_padding_mask"]
    return {**kw, "key_padding_mask": None if mask is None else mask[:, a:b]}


def _ratio_of(state: CausalState) -> torch.Tensor:
    """The state's meaning independent of its stabiliser: S / sum(z)."""
    return state.kv / state.z.sum(-1)[..., None, None]


@pytest.mark.parametrize("log_space", [True, False])
def test_absorb_keys_gives_the_state_of_the_causal_core(log_space: bool) -> None:
    pq, pk, v = _features(9, log_space, seed=2)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 2:4] = True
    _, _, ref = feature_attention_step(pq, pk, v, log_space=log_space, key_padding_mask=mask, state=None)
    first = absorb_keys(None, pk[:, :, :5], v[:, :, :5], log_space=log_space, key_padding_mask=mask[:, :5])
    got = absorb_keys(first, pk[:, :, 5:], v[:, :, 5:], log_space=log_space, key_padding_mask=mask[:, 5:])
    assert got.length == 9 and not bool(got.poisoned.any())
    torch.testing.assert_close(_ratio_of(got), _ratio_of(ref), rtol=1e-12, atol=1e-12)
    if log_space:
        torch.testing.assert_close(got.m, ref.m)
    drop = torch.zeros(2, 3, 9, dtype=torch.bool)
    drop[0, 1, 4] = True  # one head leaves a key out
    kept = absorb_keys(None, pk, v, log_space=log_space, drop=drop)
    assert not torch.allclose(kept.kv[0, 1], got.kv[0, 1]) and torch.allclose(
        kept.kv[1], absorb_keys(None, pk, v, log_space=log_space).kv[1]
    )


def test_absorb_keys_poisons_a_head_with_a_non_finite_key() -> None:
    _, pk, v = _features(5, True, seed=3)
    pk[1, 2, 3, 0] = float("nan")
    state = absorb_keys(None, pk, v, log_space=True)
    assert state.poisoned.tolist() == [[False] * 3, [False, False, True]]
    assert bool(torch.isfinite(state.kv).all() and torch.isfinite(state.z).all())
