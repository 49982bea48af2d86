"""Conversion computes the original function or refuses, never a silent other function.

Each test builds tiny random-weight ``transformers`` models offline from their configs
and checks one audited case: a module the wrapper does not reproduce (ALBERT, ConvBERT,
Nystromformer, RoFormer, LayoutLMv3) is refused at conversion naming its class; arguments
the kernelized attention does not implement (position biases, logit soft-capping,
attention sinks, ``output_attentions``) are refused when they carry a value; BERT
decoders decode with a cache exactly; OPT's call-time scaling and the per-layer scales of
GPT-2 and Gemma are the ones the converted estimator and the fit use; encoder-decoder
models are refused at conversion. CI cost: a few seconds.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.convert import HFKernelSelfAttention, convert_attention, converted_modules, distill_attention

transformers = pytest.importorskip("transformers")

from kernelattn_core.convert.decoder import kernel_attention_forward  # noqa: E402

SMALL = {
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "vocab_size": 40,
    "max_position_embeddings": 64,
}
DECODER = {
    "vocab_size": 40,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "max_position_embeddings": 64,
}


def _model(cls: Any, config: Any) -> Any:
    torch.manual_seed(0)
    return cls(config).to(torch.float64).eval()


def _ids(n: int = 9, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 40, (batch, n), generator=torch.Generator().manual_seed(1))


def _padded(n: int = 9) -> dict[str, torch.Tensor]:
    ids = _ids(n)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, as generate() pads
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def _sharpen(model: Any) -> Any:
    """Larger query/key weights, so that a wrong logit scale shows in the outputs."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "c_attn.weight")):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(2))
    return model


# ---------------------------------------------------------------------- 1. modules the wrapper does not reproduce
UNCONVERTIBLE = {
    "AlbertAttention": lambda: transformers.AlbertModel(transformers.AlbertConfig(**SMALL, embedding_size=8)),
    "ConvBertSelfAttention": lambda: transformers.ConvBertModel(
        transformers.ConvBertConfig(**SMALL, embedding_size=16)
    ),
    "NystromformerSelfAttention": lambda: transformers.NystromformerModel(
        transformers.NystromformerConfig(**SMALL, num_landmarks=4, segment_means_seq_len=8)
    ),
}


@pytest.mark.parametrize("source", sorted(UNCONVERTIBLE))
def test_attention_modules_with_more_than_the_attention_step_are_refused(source: str) -> None:
    """ALBERT's attention owns its output projection, LayerNorm and residual, ConvBERT
    its convolutions, Nystromformer its landmarks and convolution: the wrapper would drop
    them (ALBERT converted to softmax differed by 4.49), so conversion refuses them."""
    model = UNCONVERTIBLE[source]().eval()
    with pytest.raises(ka.InputError, match=rf"^model: '[\w.]+' \({source}\) .*would change the model's function"):
        convert_attention(model, "softmax")


SUPPORTED = {
    "electra": lambda: transformers.ElectraModel(transformers.ElectraConfig(**SMALL, embedding_size=16)),
    "ernie": lambda: transformers.ErnieModel(transformers.ErnieConfig(**SMALL)),
    "xlm-roberta": lambda: transformers.XLMRobertaModel(transformers.XLMRobertaConfig(**SMALL)),
    "megatron": lambda: transformers.MegatronBertModel(transformers.MegatronBertConfig(**SMALL)),
    "markuplm": lambda: transformers.MarkupLMModel(transformers.MarkupLMConfig(**SMALL)),
    "splinter": lambda: transformers.SplinterModel(transformers.SplinterConfig(**SMALL)),
    "data2vec": lambda: transformers.Data2VecTextModel(transformers.Data2VecTextConfig(**SMALL)),
}


@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_supported_bert_families_still_convert_exactly(family: str) -> None:
    torch.manual_seed(0)
    model = SUPPORTED[family]().to(torch.float64).eval()
    converted = convert_attention(model, "softmax")
    assert len(converted_modules(converted)) == 2
    batch = _padded()
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        ref = model(**batch).last_hidden_state
        out = converted(**batch).last_hidden_state
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-7, atol=1e-7)


# ---------------------------------------------------------------------- 2. BERT decoders with a cache
def _bert_decoder() -> Any:
    config = transformers.BertConfig(**SMALL, is_decoder=True, pad_token_id=0)
    model = _model(transformers.BertLMHeadModel, config)
    model.generation_config.eos_token_id = None
    return model


def test_bert_decoder_decodes_with_a_cache_exactly() -> None:
    """transformers 5 passes the cache to BertSelfAttention as ``cache=``: a converted
    layer continues its state there, so a cached step equals the full forward (the
    wrapper used to ignore the cache and attend the new token alone: 0.28)."""
    model = _bert_decoder()
    converted = convert_attention(model, "softmax")
    ids = _ids(7)
    with torch.no_grad():
        past = converted(ids[:, :6], use_cache=True).past_key_values
        step = converted(ids[:, 6:], cache=past, use_cache=True).logits[:, -1]
        full = model(ids, use_cache=False).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-10, atol=1e-10)
    inputs = _padded(6)
    kw = {"max_new_tokens": 4, "do_sample": False, "output_scores": True, "return_dict_in_generate": True}
    ours, theirs = converted.generate(**inputs, **kw), model.generate(**inputs, **kw)
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.scores, theirs.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # float32 scores of float64 models


def test_bert_decoder_generation_with_a_feature_map_equals_its_full_forward() -> None:
    converted = convert_attention(_bert_decoder(), "prf", num_features=8, seed=0)
    ids = _ids(6, batch=1)
    out = converted.generate(
        input_ids=ids, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        full = converted(out.sequences, use_cache=False).logits  # [1, N, V]
    for i, score in enumerate(out.scores):
        # generate() hands out float32 scores; the model runs in float64
        torch.testing.assert_close(score.double(), full[:, ids.shape[1] - 1 + i], rtol=1e-6, atol=1e-7)
    assert torch.equal(out.sequences[:, ids.shape[1] :], full[:, ids.shape[1] - 1 : -1].argmax(-1))


def test_a_cache_given_to_a_bidirectional_layer_is_refused() -> None:
    converted = convert_attention(_model(transformers.BertModel, transformers.BertConfig(**SMALL)), "softmax")
    layer = converted_modules(converted)[0][1]
    cache = transformers.DynamicCache()
    with pytest.raises(ka.InputError, match=r"^cache: BertSelfAttention is bidirectional"):
        layer(torch.zeros(1, 3, 16, dtype=torch.float64), None, cache=cache)


# ---------------------------------------------------------------------- 3. position information passed per call
def test_roformer_and_layoutlmv3_position_terms_are_refused_at_conversion() -> None:
    roformer = _model(transformers.RoFormerModel, transformers.RoFormerConfig(**SMALL, embedding_size=16))
    with pytest.raises(ka.InputError, match=r"\(RoFormerSelfAttention\) takes sinusoidal_pos in forward"):
        convert_attention(roformer, "softmax")
    config = transformers.LayoutLMv3Config(
        **SMALL, visual_embed=False, coordinate_size=4, shape_size=4, max_2d_position_embeddings=128
    )
    layout = _model(transformers.LayoutLMv3Model, config)
    with pytest.raises(ka.InputError, match=r"\(LayoutLMv3SelfAttention\) .*config.has_relative_attention_bias"):
        convert_attention(layout, "softmax")


@pytest.mark.parametrize("name", ["position_bias", "rel_pos", "sinusoidal_pos", "position_embeddings"])
def test_keyword_arguments_the_wrapper_does_not_implement_are_refused(name: str) -> None:
    """The wrapper's forward took ``**kwargs`` and dropped them: a position bias or
    sinusoidal positions passed by keyword were lost silently."""
    converted = convert_attention(_model(transformers.BertModel, transformers.BertConfig(**SMALL)), "softmax")
    layer = converted_modules(converted)[0][1]
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    with pytest.raises(ka.InputError, match=rf"^{name}: not supported by kernelized self-attention \(got a Tensor"):
        layer(x, None, **{name: torch.zeros(1, 2, 5, 5, dtype=torch.float64)})
    out, weights = layer(x, None, position_ids=None, output_attentions=False, use_cache=True, **{name: None})
    assert weights is None and out.shape == (1, 5, 16)


def test_arguments_passed_by_position_are_read_by_their_names() -> None:
    converted = convert_attention(_model(transformers.BertModel, transformers.BertConfig(**SMALL)), "softmax")
    layer = converted_modules(converted)[0][1]
    assert isinstance(layer, HFKernelSelfAttention) and layer.call_names[:3] == (
        "hidden_states",
        "attention_mask",
        "cache",
    )
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    with pytest.raises(ka.InputError, match=r"^cache: BertSelfAttention is bidirectional"):
        layer(x, None, transformers.DynamicCache())
    with pytest.raises(ka.InputError, match=r"^hidden_states: BertSelfAttention.forward takes at most 3 positional"):
        layer(x, None, None, None)


def test_bert_decoder_refuses_a_bidirectional_mask_with_a_state_naming_use_cache() -> None:
    """The encoder wrapper's cached path refuses a bidirectional 4-D mask with the same
    message as the converted decoders (it said only "decoding with a state is causal")."""
    converted = convert_attention(_bert_decoder(), "softmax")
    layer = converted_modules(converted)[0][1]
    x = torch.randn(1, 3, 16, dtype=torch.float64)
    both_ways = torch.zeros(1, 1, 3, 3, dtype=torch.float64)  # every query attends every key
    with pytest.raises(ka.InputError, match=r"^attention_mask: this call's mask is bidirectional.*use_cache=False"):
        layer(x, both_ways, transformers.DynamicCache())


def test_a_failed_cached_call_leaves_no_bert_layer_armed_for_a_foreign_update() -> None:
    """The wrapper armed its state layer before its checks; a call that failed after that
    left it open, and the original model's next update was accepted there silently."""
    converted = convert_attention(_bert_decoder(), "softmax")
    original = _bert_decoder()
    ids = _ids(7)
    with torch.no_grad():
        past = converted(ids[:, :6], use_cache=True).past_key_values
        layer = converted_modules(converted)[0][1]
        with pytest.raises(ka.InputError):
            layer(torch.zeros(1, 2, 7, dtype=torch.float64), None, past)  # a wrong hidden width
        with pytest.raises(ka.InputError):
            layer(torch.zeros(1, 3, 16, dtype=torch.float64), torch.zeros(1, 1, 3, 3, dtype=torch.float64), past)
        assert not any(getattr(cache_layer, "armed", False) for cache_layer in past.layers)
        with pytest.raises(ka.InputError, match=r"^past_key_values: this cache holds a kernelized model"):
            original(ids[:, 6:], cache=past, use_cache=True)
        assert [cache_layer.length for cache_layer in past.layers] == [6, 6]


# ---------------------------------------------------------------------- 4. soft-capping and attention sinks
def test_gemma2_logit_softcapping_is_refused_at_conversion_and_at_call_time() -> None:
    capped = transformers.Gemma2Config(**DECODER, query_pre_attn_scalar=16, sliding_window=64)
    assert capped.attn_logit_softcapping is not None  # Gemma 2's default caps the logits
    with pytest.raises(ka.InputError, match=r"^attn_logit_softcapping: Gemma2Attention caps its attention logits"):
        convert_attention(_model(transformers.Gemma2ForCausalLM, capped), "softmax")
    plain = transformers.Gemma2Config(
        **DECODER, query_pre_attn_scalar=16, sliding_window=64, attn_logit_softcapping=None
    )
    converted = convert_attention(_model(transformers.Gemma2ForCausalLM, plain), "softmax")
    converted_modules(converted)[0][1].attn_logit_softcapping = 5.0  # set after conversion: refused when called
    with pytest.raises(ka.InputError, match=r"^softcap: Gemma2Attention caps its attention logits"):
        converted(input_ids=_ids())


def test_gpt_oss_attention_sinks_are_refused_at_conversion_and_at_call_time() -> None:
    config = transformers.GptOssConfig(
        **DECODER, num_local_experts=2, num_experts_per_tok=1, sliding_window=64, layer_types=["full_attention"] * 2
    )
    with pytest.raises(ka.InputError, match=r"^model: GptOssAttention has learned attention sinks"):
        convert_attention(_model(transformers.GptOssForCausalLM, config), "softmax")
    llama = convert_attention(_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**DECODER)), "softmax")
    module = converted_modules(llama)[0][1]
    q = torch.randn(1, 4, 3, 4, dtype=torch.float64)
    kv = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    with pytest.raises(ka.InputError, match=r"^s_aux: LlamaAttention has learned attention sinks"):
        kernel_attention_forward(module, q, kv, kv, None, scaling=0.5, s_aux=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ka.InputError, match=r"^cu_seq_lens_q: LlamaAttention passes it to the attention function"):
        kernel_attention_forward(module, q, kv, kv, None, scaling=0.5, cu_seq_lens_q=torch.tensor([0, 3]))
    out, _ = kernel_attention_forward(module, q, kv, kv, None, scaling=0.5, sliding_window=None, s_aux=None)
    assert out.shape == (1, 3, 4, 4)


# ---------------------------------------------------------------------- 5. the teacher's scale when fitting
SCALED = {
    "gpt2-inverse-layer-idx": lambda: _model(
        transformers.GPT2LMHeadModel,
        transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2, scale_attn_by_inverse_layer_idx=True),
    ),
    "gpt2-unscaled": lambda: _model(
        transformers.GPT2LMHeadModel,
        transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2, scale_attn_weights=False),
    ),
    "gemma-query-pre-attn-scalar": lambda: _model(
        transformers.Gemma2ForCausalLM,
        transformers.Gemma2Config(**DECODER, query_pre_attn_scalar=64, sliding_window=64, attn_logit_softcapping=None),
    ),
}


@pytest.mark.parametrize("kind", sorted(SCALED))
def test_an_exact_copy_of_a_model_with_its_own_logit_scale_fits_with_zero_error(kind: str) -> None:
    """The fit's teacher rows use the scale the layer applies (the converted
    estimator's), not 1/sqrt(d): GPT-2's layer 1 had error_before 0.21 for an exact copy."""
    model = _sharpen(SCALED[kind]())
    converted = convert_attention(model, "softmax")
    report = distill_attention(converted, model, [_padded()], steps=0, progress=False)
    assert len(report.layers) == 2
    for layer in report.layers:
        assert layer.error_before < 1e-10 and abs(layer.loss_before) < 1e-10, layer


# ---------------------------------------------------------------------- 6. encoder-decoder models
def test_encoder_decoder_models_are_refused_at_conversion() -> None:
    bart = transformers.BartConfig(
        vocab_size=40,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
    )
    with pytest.raises(ka.InputError, match=r"^model: BartAttention belongs to an encoder-decoder model"):
        convert_attention(_model(transformers.BartForConditionalGeneration, bart), "softmax")
    whisper = transformers.WhisperConfig(
        vocab_size=40,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_mel_bins=8,
        max_source_positions=16,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    with pytest.raises(ka.InputError, match=r"^model: WhisperAttention belongs to an encoder-decoder model"):
        convert_attention(_model(transformers.WhisperForConditionalGeneration, whisper), "softmax")


def test_a_decoder_with_unconverted_cross_attention_is_refused_at_conversion() -> None:
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2, add_cross_attention=True)
    with pytest.raises(
        ka.InputError, match=r"^model: 'transformer.h.0.crossattention' \(GPT2Attention\) is an attention"
    ):
        convert_attention(_model(transformers.GPT2LMHeadModel, config), "softmax")


# ---------------------------------------------------------------------- 7. OPT's call-time scaling
def test_opt_which_scales_the_query_itself_converts_exactly() -> None:
    """OPT multiplies the query by its ``scaling`` and passes ``scaling=1.0``: the
    estimator takes the call's 1.0 (it took the attribute, and every forward failed)."""
    config = transformers.OPTConfig(
        vocab_size=40, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2, word_embed_proj_dim=16
    )
    model = _sharpen(_model(transformers.OPTForCausalLM, config))
    model.generation_config.eos_token_id = None
    converted = convert_attention(model, "softmax")
    assert all(m.estimator.scale == 1.0 for _, m in converted_modules(converted))
    batch = _padded()
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        torch.testing.assert_close(converted(**batch).logits[keep], model(**batch).logits[keep], rtol=1e-10, atol=1e-10)
    kw = {"max_new_tokens": 3, "do_sample": False}
    assert torch.equal(converted.generate(**batch, **kw), model.generate(**batch, **kw))
    report = distill_attention(converted, model, [batch], steps=0, progress=False)
    assert max(layer.error_before for layer in report.layers) < 1e-10


# ---------------------------------------------------------------------- 8. output_attentions on decoders
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_output_attentions_is_refused_by_converted_decoders(family: str) -> None:
    if family == "llama":
        model = _model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**DECODER))
    else:
        model = _model(
            transformers.GPT2LMHeadModel, transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2)
        )
    converted = convert_attention(model, "prf", num_features=8, seed=0)
    with pytest.raises(
        ka.InputError, match=r"^output_attentions: kernelized attention never forms the attention weights"
    ):
        converted(input_ids=_ids(), output_attentions=True)
    with torch.no_grad():
        assert converted(input_ids=_ids(), output_attentions=False).attentions is None
