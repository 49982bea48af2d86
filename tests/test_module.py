"""KernelAttention against torch.nn.MultiheadAttention."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kernelattn_core as ka
from kernelattn_core.module import KVCache


def _padded_rows_zeroed(x: torch.Tensor, pad: torch.Tensor, batch_first: bool = True) -> torch.Tensor:
    """``x`` (``[B, N, E]``, or ``[N, B, E]``) with the padded rows ``pad [B, N]`` zeroed:
    what KernelAttention's self-attention feeds its projections (a padded query row's output
    is then that of a zero input row; torch's MultiheadAttention attends the row as given)."""
    return x.masked_fill((pad if batch_first else pad.T)[..., None], 0.0)


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
    x0 = _padded_rows_zeroed(x, mask, batch_first)  # every row, the padded ones included
    ref, _ = mha(x0, x0, x0, key_padding_mask=mask, attn_mask=attn_mask, need_weights=False)
    out, weights = ours(x, x, x, key_padding_mask=mask, is_causal=causal)
    assert weights is None
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    keep = ~mask if batch_first else ~mask.T  # the unpadded rows: MultiheadAttention's on x itself
    torch.testing.assert_close(out[keep], mha(x, x, x, key_padding_mask=mask, attn_mask=attn_mask)[0][keep])


def test_cross_attention_with_kdim_vdim(use_registry) -> None:
    attn = ka.KernelAttention(12, 3, "toy-prf", kdim=5, vdim=7, num_features=8, batch_first=True)
    out, _ = attn(torch.randn(2, 4, 12), torch.randn(2, 9, 5), torch.randn(2, 9, 7))
    assert out.shape == (2, 4, 12)


def test_module_trains_end_to_end(use_registry) -> None:
    torch.manual_seed(0)
    attn = ka.KernelAttention(8, 2, "toy-prf", causal=True, redraw_every=1, num_features=8, batch_first=True)
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
    attn = ka.KernelAttention(8, 2, batch_first=True)
    with pytest.raises(ka.InputError, match="attn_mask: only the causal mask"):
        attn(torch.randn(1, 3, 8), attn_mask=torch.eye(3, dtype=torch.bool))
    with pytest.raises(ka.InputError, match=r"query: expected last dimension 8, got shape \(1, 3, 6\)"):
        attn(torch.randn(1, 3, 6))


# ---------------------------------------------------------------------- pretrained MHA, masks, decoding
def _mha(batch_first: bool = True, **kw) -> nn.MultiheadAttention:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return nn.MultiheadAttention(16, 4, batch_first=batch_first, dtype=torch.float64, **kw)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_from_multihead_reproduces_mha_with_padding_and_causal_masks(batch_first: bool, mask_kind: str) -> None:
    mha = _mha(batch_first)
    before = {k: v.clone() for k, v in mha.state_dict().items()}
    ours = ka.KernelAttention.from_multihead(mha, "softmax")
    assert ours.batch_first is batch_first and ours.q_proj.weight.dtype == torch.float64
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    x = x if batch_first else x.transpose(0, 1)  # [N, B, E] read as such
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64)  # 0 / -inf
    attn_mask = {"none": None, "bool": torch.isneginf(causal), "float": causal}[mask_kind]
    # the additive float form of key_padding_mask, as TransformerEncoderLayer passes it
    fpad = torch.zeros(3, 7, dtype=torch.float64).masked_fill(pad, float("-inf"))
    mha_pad = fpad if mask_kind == "float" else pad  # torch wants matching mask types
    x0 = _padded_rows_zeroed(x, pad, batch_first)  # self-attention: padded query rows enter as 0
    ref, _ = mha(x0, x0, x0, key_padding_mask=mha_pad, attn_mask=attn_mask, need_weights=False)
    out, w = ours(x, x, x, key_padding_mask=pad, attn_mask=attn_mask)
    assert w is None
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours(x, key_padding_mask=fpad, attn_mask=attn_mask)[0], ref, rtol=1e-10, atol=1e-12)
    assert all(torch.equal(before[k], v) for k, v in mha.state_dict().items())  # original untouched


def test_from_multihead_with_kdim_vdim_and_no_bias() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(12, 3, kdim=5, vdim=7, bias=False, batch_first=True, dtype=torch.float64)
    ours = ka.KernelAttention.from_multihead(mha)
    q, k, v = (torch.randn(2, n, e, dtype=torch.float64) for n, e in ((4, 12), (6, 5), (6, 7)))
    torch.testing.assert_close(ours(q, k, v)[0], mha(q, k, v, need_weights=False)[0], rtol=1e-10, atol=1e-12)
    assert ours.q_proj.bias is None


def test_load_multihead_state_dict_keeps_the_estimators_state() -> None:
    mha = _mha()
    ours = ka.KernelAttention(16, 4, "prf", num_features=8, dtype=torch.float64)
    omega = ours.estimator.feature_map.omega.clone()
    ours.load_state_dict(mha.state_dict())  # strict: MHA keys mapped, estimator keys kept
    assert torch.equal(ours.estimator.feature_map.omega, omega)
    torch.testing.assert_close(ours.q_proj.weight, mha.in_proj_weight[:16])
    torch.testing.assert_close(ours.v_proj.bias, mha.in_proj_bias[32:])
    torch.testing.assert_close(ours.out_proj.weight, mha.out_proj.weight)
    with pytest.raises(ka.InputError, match="add_bias_kv"):
        ka.KernelAttention.from_multihead(_mha(add_bias_kv=True))


def test_refusals_name_the_argument() -> None:
    attn = ka.KernelAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    with pytest.raises(ka.InputError, match="need_weights: kernelized attention never forms"):
        attn(x, x, x, need_weights=True)
    with pytest.raises(ka.InputError, match="is_causal: True was given with an attn_mask"):
        attn(x, attn_mask=torch.zeros(3, 3, dtype=torch.bool), is_causal=True)
    with pytest.raises(ka.InputError, match="attn_mask: an additive float mask must hold 0 and -inf only"):
        attn(x, attn_mask=torch.full((3, 3), 0.5))
    with pytest.raises(ka.InputError, match="key_padding_mask: a float mask must be additive"):
        attn(x, key_padding_mask=torch.full((2, 3), -1.0))
    with pytest.raises(ka.InputError, match=r"key_padding_mask: expected shape \[B, M\] = \[2, 3\]"):
        attn(x, key_padding_mask=torch.zeros(3, 2, dtype=torch.bool))
    # an all-allowed mask is no mask; is_causal=True alone is causal
    torch.testing.assert_close(attn(x, attn_mask=torch.zeros(3, 3))[0], attn(x)[0])
    causal = torch.ones(3, 3, dtype=torch.bool).triu(1)
    torch.testing.assert_close(attn(x, is_causal=True)[0], attn(x, attn_mask=causal)[0])
    assert not torch.allclose(attn(x, is_causal=True)[0], attn(x)[0])


@pytest.mark.parametrize("estimator", ["softmax", "elu"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_step_decodes_like_the_causal_forward(estimator: str, batch_first: bool) -> None:
    torch.manual_seed(0)
    attn = ka.KernelAttention(16, 4, estimator, batch_first=batch_first, dtype=torch.float64).eval()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 2] = True
    seq = x if batch_first else x.transpose(0, 1)
    full, _ = attn(seq, key_padding_mask=pad, is_causal=True)
    state, outs = None, []
    for t in range(6):
        xt = x[:, t : t + 1] if batch_first else x[:, t : t + 1].transpose(0, 1)
        out, state = attn.step(xt, state, key_padding_mask=pad[:, t : t + 1])
        outs.append(out)
    steps = torch.cat(outs, 1 if batch_first else 0)
    torch.testing.assert_close(steps, full, rtol=1e-9, atol=1e-11)
    if estimator == "softmax":
        assert isinstance(state, KVCache) and state.length == 6


def test_default_layout_is_multihead_attentions_sequence_first() -> None:
    """A module built by hand with the defaults is a drop-in for nn.MultiheadAttention's
    defaults: inside nn.TransformerEncoderLayer(batch_first=False) it reads [N, B, E]."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, dtype=torch.float64).eval()
    assert layer.self_attn.batch_first is False
    ours = ka.KernelAttention(16, 4, "softmax", dtype=torch.float64)
    assert ours.batch_first is False
    ours.load_state_dict(layer.self_attn.state_dict())
    x = torch.randn(7, 3, 16, dtype=torch.float64)  # [N, B, E]
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        ref = layer(x, src_key_padding_mask=pad)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    layer.self_attn = ours
    out = layer(x, src_key_padding_mask=pad)
    keep = ~pad.T  # [N, B]: a padded row's attention is that of a zero input row (the residual differs)
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-10, atol=1e-10)
    assert torch.isfinite(out).all()
    # read as [B, N, E] (the old default), the same input gives another function
    ref_plain = layer(x)
    ours.batch_first = True
    assert not torch.allclose(layer(x), ref_plain, atol=1e-3)


def test_transformer_encoder_accepts_kernel_attention_as_self_attn() -> None:
    """The issue's AttributeError: nn.TransformerEncoder reads self_attn._qkv_same_embed_dim."""
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True)
    layer.self_attn = ka.KernelAttention(16, 4, "elu", batch_first=True)
    with pytest.warns(UserWarning, match="_qkv_same_embed_dim was not True"):
        encoder = nn.TransformerEncoder(layer, 2)
    encoder.eval()
    x = torch.randn(2, 5, 16)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[0, 3:] = True
    with torch.no_grad():
        out = encoder(x, src_key_padding_mask=pad)
    assert out.shape == (2, 5, 16) and torch.isfinite(out).all()


@pytest.mark.parametrize("estimator", ["softmax", "elu", "prf", "hedgehog", "sliding-window"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 1e30])
def test_padded_key_and_value_inputs_never_reach_a_gradient(estimator: str, poison: float) -> None:
    """Whatever the key/value inputs hold at padded positions, the output and every
    parameter's gradient equal those of a clean run (the projections' weight gradients sum
    over every row, padded ones included, unless the padded rows are zeroed first)."""
    torch.manual_seed(0)
    attn = ka.KernelAttention(16, 2, estimator, batch_first=True, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    q, kv = (
        torch.randn(3, 5, 16, dtype=torch.float64, generator=g),
        torch.randn(3, 7, 16, dtype=torch.float64, generator=g),
    )
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 5:], pad[2, 2:] = True, True
    results = []
    for value in (0.0, poison):
        attn.zero_grad()
        x = kv.masked_fill(pad[:, :, None], value)
        out, _ = attn(q, x, x, key_padding_mask=pad)
        out.sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in attn.named_parameters()}))
    (clean, clean_grads), (dirty, dirty_grads) = results
    torch.testing.assert_close(dirty, clean, rtol=1e-12, atol=1e-12)
    for name, grad in clean_grads.items():
        torch.testing.assert_close(dirty_grads[name], grad, rtol=1e-12, atol=1e-12, msg=name)


def test_constructor_and_dtype_refusals_name_the_argument() -> None:
    for kwargs, match in (
        ({"kdim": 0}, r"kdim: expected an integer >= 1, got 0"),
        ({"vdim": 2.5}, r"vdim: expected an integer >= 1, got 2.5"),
        ({"device": "bogus"}, r"device: expected a torch device"),
        ({"dtype": torch.int64}, r"dtype: expected None or a floating-point torch.dtype"),
        ({"dtype": "float32"}, r"dtype: expected None or a floating-point torch.dtype"),
    ):
        with pytest.raises(ka.InputError, match=match):
            ka.KernelAttention(8, 2, **kwargs)
    attn = ka.KernelAttention(8, 2, batch_first=True, dtype=torch.float64)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with pytest.raises(ka.InputError, match=r"key: expected dtype torch.float64 \(the module's parameters"):
        attn(x, x.float(), x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts: no refusal
        out, _ = ka.KernelAttention(8, 2, batch_first=True)(torch.randn(2, 3, 8).bfloat16())
    assert out.shape == (2, 3, 8)


def test_multihead_only_arguments_are_refused_by_the_module_not_blamed_on_the_estimator() -> None:
    for kwargs, match in (
        ({"add_bias_kv": True}, r"add_bias_kv: nn.MultiheadAttention's add_bias_kv=True is not supported"),
        ({"add_zero_attn": True}, r"add_zero_attn: nn.MultiheadAttention's add_zero_attn=True is not supported"),
        ({"dropout": 0.1}, r"dropout: nn.MultiheadAttention's dropout=0.1 is not supported: KernelAttention applies"),
    ):
        with pytest.raises(ka.InputError, match=match):
            ka.KernelAttention(16, 2, "prf", **kwargs)
    ka.KernelAttention(16, 2, "prf", dropout=0.0, add_bias_kv=False, add_zero_attn=False)  # asking for nothing
    with pytest.raises(ka.InputError, match=r"estimator: expected a registry name .*got FeatureMapAttention"):
        ka.KernelAttention(16, 2, ka.create("prf", num_features=8))  # type: ignore[arg-type]


@pytest.mark.parametrize("where", ["direct-is_causal-false", "encoder-layer", "encoder", "decoder-layer"])
def test_a_causal_module_stays_causal_inside_the_torch_layers(where: str) -> None:
    """``nn.TransformerEncoderLayer``/``DecoderLayer`` pass ``is_causal=False`` by default;
    it was read as "not causal", so a ``KernelAttention(causal=True)`` there let a later
    token change every earlier row. As in ``nn.MultiheadAttention``, ``False`` removes no
    masking: a later token changes no earlier row."""
    torch.manual_seed(0)
    attn = ka.KernelAttention(16, 2, estimator="prf", num_features=8, causal=True, batch_first=True, seed=0)
    x = torch.randn(2, 6, 16)
    later = x.clone()
    later[:, 5] += 10.0  # only the last token changes
    if where == "direct-is_causal-false":
        run = lambda t: attn(t, t, t, is_causal=False)[0]  # noqa: E731
    elif where == "decoder-layer":
        layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
        layer.self_attn = attn
        memory = torch.randn(2, 4, 16)
        run = lambda t: layer(t, memory)  # noqa: E731
    else:
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
        layer.self_attn = attn
        model = layer if where == "encoder-layer" else nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        run = model.eval()
    with torch.no_grad():
        a, b = run(x), run(later)
    torch.testing.assert_close(a[:, :5], b[:, :5], rtol=0, atol=0)
    assert (a[:, 5] - b[:, 5]).abs().max() > 1e-3  # the changed row itself moves


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_a_nested_tensor_from_the_encoders_fast_path_is_refused_by_name() -> None:
    """A ``KernelAttention`` swapped into an ``nn.TransformerEncoder`` built with its
    default nested-tensor fast path got packed padded batches in eval and crashed deep in
    torch ("NestedTensorImpl doesn't support sizes")."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2)  # enable_nested_tensor=True by default
    for sub in encoder.layers:
        sub.self_attn = ka.KernelAttention(16, 2, estimator="elu", batch_first=True)
    x = torch.randn(2, 5, 16)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    with torch.no_grad(), pytest.raises(ka.InputError, match=r"^query: expected a dense tensor, got a nested tensor"):
        encoder.eval()(x, src_key_padding_mask=pad)
    encoder.use_nested_tensor = False  # the way out the message names
    with torch.no_grad():
        assert torch.isfinite(encoder(x, src_key_padding_mask=pad)[~pad]).all()
