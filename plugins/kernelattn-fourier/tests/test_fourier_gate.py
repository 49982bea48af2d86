"""RFA-Gate: the chunked causal form against the per-position recurrence, on outputs and
gradients; padding and future positions never reach an output."""

from __future__ import annotations

import pytest
import torch
from kernelattn_fourier.gate import Gate, gated_attention, gated_attention_naive


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
