"""KernelAttention's input guards: what a padded query row holds never reaches a
gradient (self-attention), and tensors on another device are refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kernelattn_core as ka

ESTIMATORS = {
    "softmax": {},
    "prf": {"num_features": 16, "seed": 0},
    "elu": {},
    "hedgehog": {"num_features": 8},
    "sliding-window": {"window": 2, "num_features": 8},
}


def _module(name: str) -> ka.KernelAttention:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
    return ka.KernelAttention.from_multihead(mha, name, **ESTIMATORS[name])


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(3, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[0, 4:] = True  # right padding
    pad[2, :2] = True  # left padding
    return x, pad


def _run(attn: ka.KernelAttention, query: torch.Tensor, kv: torch.Tensor, pad: torch.Tensor, causal: bool):  # type: ignore[no-untyped-def]
    attn.zero_grad()
    out, _ = attn(query, kv, kv, key_padding_mask=pad, is_causal=causal)
    out[~pad].sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_a_padded_query_row_reaches_no_output_and_no_gradient(name: str, causal: bool) -> None:
    """Self-attention with NaN at the padded positions: every parameter gradient is finite
    and equals that of a clean run, the unpadded rows are bit for bit those of the call
    that projects the query as given, and the padded rows are finite and independent of
    what the padded positions hold."""
    attn = _module(name)
    x, pad = _inputs()
    poisoned = x.masked_fill(pad[..., None], float("nan"))
    out, grads = _run(attn, poisoned, poisoned, pad, causal)  # query is key: self-attention
    clean_out, clean_grads = _run(attn, x, x, pad, causal)
    assert grads.keys() == clean_grads.keys() and "q_proj.weight" in grads and "out_proj.weight" in grads
    for n, grad in clean_grads.items():
        assert bool(torch.isfinite(grads[n]).all()), n
        torch.testing.assert_close(grads[n], grad, rtol=1e-12, atol=1e-14, msg=n)
    assert bool(torch.isfinite(out).all())
    assert torch.equal(out, clean_out)  # padded rows too: a zero input row's attention
    # the unpadded rows are unchanged: equal to the call that does not zero query rows
    # (a query that is another tensor, as in cross-attention)
    as_given, _ = attn(x.clone(), x, x, key_padding_mask=pad, is_causal=causal)
    assert torch.equal(out[~pad], as_given[~pad])
    assert not torch.allclose(out[pad], as_given[pad])


@pytest.mark.parametrize("name", ["prf", "softmax"])
def test_cross_attention_query_rows_are_not_masked(name: str) -> None:
    """The negative control: a query that is another tensor is not at the key positions,
    so its rows are not masked (as in torch's MultiheadAttention, a NaN query row reaches
    the weight gradients); the same positions as self-attention are."""
    attn = _module(name)
    x, pad = _inputs()
    poisoned = x.masked_fill(pad[..., None], float("nan"))
    _, grads = _run(attn, poisoned.clone(), poisoned, pad, False)
    assert not bool(torch.isfinite(grads["q_proj.weight"]).all())
    assert not bool(torch.isfinite(grads["out_proj.weight"]).all())
    _, grads = _run(attn, poisoned, poisoned, pad, False)
    assert all(bool(torch.isfinite(g).all()) for g in grads.values())


def test_a_padded_query_row_of_a_decoding_step_is_masked_too() -> None:
    """step is self-attention: NaN at a padded new position leaves the state, the later
    outputs and every gradient finite."""
    attn = _module("elu").train()
    x, pad = _inputs()
    poisoned = x.masked_fill(pad[..., None], float("nan"))
    state, outs = None, []
    for t in range(6):
        out, state = attn.step(poisoned[:, t : t + 1], state, key_padding_mask=pad[:, t : t + 1])
        outs.append(out)
    out = torch.cat(outs, 1)
    full, _ = attn(x, key_padding_mask=pad, is_causal=True)
    assert torch.equal(out.isfinite(), torch.ones_like(out, dtype=torch.bool))
    torch.testing.assert_close(out[~pad], full[~pad], rtol=1e-10, atol=1e-12)
    out[~pad].sum().backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in attn.parameters() if p.grad is not None)


# ---------------------------------------------------------------------- devices
def _attn() -> ka.KernelAttention:
    return ka.KernelAttention(16, 4, "prf", num_features=8, batch_first=True, seed=0)


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("query", lambda m, x: m(x.to("meta"))),
        ("key", lambda m, x: m(x, x.to("meta"), x)),
        ("value", lambda m, x: m(x, x, x.to("meta"))),
        ("key_padding_mask", lambda m, x: m(x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool, device="meta"))),
        ("key_padding_mask", lambda m, x: m(x, key_padding_mask=torch.zeros(2, 5, device="meta"))),
        ("attn_mask", lambda m, x: m(x, attn_mask=torch.zeros(5, 5, dtype=torch.bool, device="meta"))),
        ("attn_mask", lambda m, x: m(x, attn_mask=nn.Transformer.generate_square_subsequent_mask(5, device="meta"))),
        (
            "key_padding_mask",
            lambda m, x: m.step(x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool, device="meta")),
        ),
    ],
)
def test_a_tensor_on_another_device_is_refused_by_name(argument: str, call) -> None:  # type: ignore[no-untyped-def]
    attn, x = _attn(), torch.randn(2, 5, 16)
    with pytest.raises(ka.InputError, match=rf"^{argument}: expected device cpu\b.*, got meta$"):
        call(attn, x)


def test_inputs_on_another_device_than_the_parameters_are_refused() -> None:
    attn = _attn().to("meta")
    with pytest.raises(ka.InputError, match=r"^query: expected device meta \(the module's parameters.*got cpu$"):
        attn(torch.randn(2, 5, 16))
    out, _ = _attn()(torch.randn(2, 5, 16), key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))  # the control
    assert out.shape == (2, 5, 16)
