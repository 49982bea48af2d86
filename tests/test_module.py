"""KernelAttention against torch.nn.MultiheadAttention."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kernelattn_core as ka


def _copy_weights(mha: nn.MultiheadAttention, ours: ka.KernelAttention) -> None:
    e = mha.embed_dim
    with torch.no_grad():
        for i, proj in enumerate((ours.q_proj, ours.k_proj, ours.v_proj)):
            proj.weight.copy_(mha.in_proj_weight[i * e : (i + 1) * e])
            proj.bias.copy_(mha.in_proj_bias[i * e : (i + 1) * e])
        ours.out_proj.weight.copy_(mha.out_proj.weight)
        ours.out_proj.bias.copy_(mha.out_proj.bias)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_kernel_attention_equals_multihead_attention(batch_first: bool, causal: bool) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first, dtype=torch.float64)
    ours = ka.KernelAttention(16, 4, "softmax", batch_first=batch_first, dtype=torch.float64)
    _copy_weights(mha, ours)
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    if not batch_first:
        x = x.transpose(0, 1)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[1, 5:] = True
    attn_mask = torch.ones(7, 7, dtype=torch.bool).triu(1) if causal else None
    ref, _ = mha(x, x, x, key_padding_mask=mask, attn_mask=attn_mask, need_weights=False)
    out, weights = ours(x, x, x, key_padding_mask=mask, is_causal=causal)
    assert weights is None
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_cross_attention_with_kdim_vdim(use_registry) -> None:
    attn = ka.KernelAttention(12, 3, "toy-prf", kdim=5, vdim=7, num_features=8)
    out, _ = attn(torch.randn(2, 4, 12), torch.randn(2, 9, 5), torch.randn(2, 9, 7))
    assert out.shape == (2, 4, 12)


def test_module_trains_end_to_end(use_registry) -> None:
    torch.manual_seed(0)
    attn = ka.KernelAttention(8, 2, "toy-prf", causal=True, redraw_every=1, num_features=8)
    opt = torch.optim.Adam(attn.parameters(), lr=0.05)
    x = torch.randn(4, 6, 8)
    target = torch.randn(4, 6, 8)
    losses = []
    for _ in range(40):
        loss = ((attn(x)[0] - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in attn.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_module_errors() -> None:
    with pytest.raises(ka.InputError, match="num_heads: expected a divisor of embed_dim = 10, got 3"):
        ka.KernelAttention(10, 3)
    attn = ka.KernelAttention(8, 2)
    with pytest.raises(ka.InputError, match="attn_mask: only None is supported"):
        attn(torch.randn(1, 3, 8), attn_mask=torch.zeros(3, 3))
    with pytest.raises(ka.InputError, match=r"query: expected last dimension 8, got shape \(1, 3, 6\)"):
        attn(torch.randn(1, 3, 6))
