"""Converted Hugging Face decoders: the defects of the fourteenth audit.

A decoder built on the meta device is refused at conversion; a converted model's decoding
state refuses to serve the original (softmax) attention; Mixtral's ``output_router_logits``
and GPT-NeoX's ``head_size`` convert; a bidirectional 4-D mask on a call with a decoding
state is refused with the true alternative; the ``convert --help`` text describes the
decoder stages. Tiny random-weight models, float64. CI cost: about 15 s.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.convert import convert_attention, converted_modules

transformers = pytest.importorskip("transformers")

from kernelattn_core.convert.cache import KernelCache, KernelStateLayer  # noqa: E402

SIZES = {
    "vocab_size": 40,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _llama() -> Any:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, num_key_value_heads=2))
    model.generation_config.eos_token_id = None
    return model.to(torch.float64).eval()


def _mixtral() -> Any:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        **SIZES, num_key_value_heads=2, num_local_experts=2, sliding_window=None, experts_implementation="eager"
    )  # eager experts: grouped_mm takes no float64
    model = transformers.MixtralForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model.to(torch.float64).eval()


def _gpt_neox(**extra: Any) -> Any:
    torch.manual_seed(0)
    sizes = {k: v for k, v in SIZES.items() if k != "max_position_embeddings"}
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**sizes, **extra))
    model.generation_config.eos_token_id = None
    return model.to(torch.float64).eval()


def _padded(n: int = 9) -> dict[str, torch.Tensor]:
    """Two sequences, the second left-padded by three (as generate() pads)."""
    ids = torch.randint(3, 40, (2, n), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :3] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def _scores_equal_full_forward(model: Any, inputs: dict[str, torch.Tensor], new: int = 5) -> None:
    """Greedy generation on the decoding state gives, at every step, the logits of the
    full causal forward of the generated sequence (positions from the padding mask)."""
    n = inputs["input_ids"].shape[1]
    out = model.generate(
        **inputs, max_new_tokens=new, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, new, dtype=torch.long)], 1)
    with torch.no_grad():
        full = model(
            out.sequences, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=False
        ).logits
    for i, score in enumerate(out.scores):  # generate() hands out float32 scores of the float64 model
        torch.testing.assert_close(score.double(), full[:, n - 1 + i], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------- 1. the meta device
@pytest.mark.parametrize(("name", "options"), [("prf", {"num_features": 8, "seed": 0}), ("softmax", {})])
def test_a_decoder_on_the_meta_device_is_refused_at_conversion(name: str, options: dict[str, Any]) -> None:
    """An estimator built on the meta device is never initialised by ``to_empty()`` and
    ``load_state_dict()`` (prf's logits were NaN, sliding-window's off by 0.58). The
    skeleton is moved to the meta device rather than built under ``torch.device("meta")``:
    that context intercepts the factory functions it saw first in the process, and
    conftest's NaN-filling ``torch.empty`` may be one of them (the whole suite in one
    process built the model on the CPU)."""
    skeleton = _llama().to(device="meta")
    assert all(p.is_meta for p in skeleton.parameters())
    with pytest.raises(ka.InputError, match=r"^model: .*LlamaAttention.* on the meta device") as info:
        convert_attention(skeleton, name, **options)
    assert "convert after loading the real weights" in str(info.value)
    assert "expected parameters on a real device, got meta" in str(info.value)


def test_one_attention_left_on_the_meta_device_is_refused() -> None:
    model = _llama()
    model.model.layers[1].self_attn.to_empty(device="meta")
    with pytest.raises(ka.InputError, match=r"^model: .* on the meta device"):
        convert_attention(model, "hedgehog", num_features=8)
    converted = convert_attention(_llama(), "hedgehog", num_features=8)  # real weights: converts
    assert all(not p.is_meta for p in converted.parameters())


# ---------------------------------------------------------------------- 2. the original on a converted cache
def test_the_original_model_refuses_a_converted_models_decoding_state() -> None:
    """The original model used to run on a converted model's cache silently, attending the
    new token alone (logits off by 0.53)."""
    base = _llama()
    converted = convert_attention(base, "prf", num_features=8, seed=0)
    ids = _padded()["input_ids"][:1]
    out = converted.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache.layers[0], KernelStateLayer)
    with torch.no_grad(), pytest.raises(ka.InputError, match=r"^past_key_values: .*recurrent state") as info:
        base(out.sequences[:, -1:], cache=cache)
    assert "cannot serve softmax attention" in str(info.value)
    # the converted model continues the same cache as before: the full forward's last logits
    with torch.no_grad():
        step = converted(out.sequences[:, -1:], cache=cache).logits[:, -1]
        full = converted(out.sequences, use_cache=False).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-9, atol=1e-9)


def test_a_state_layer_updated_by_no_converted_attention_is_refused() -> None:
    layer = KernelStateLayer()
    k = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ka.InputError, match=r"^past_key_values: "):
        layer.update(k, k)
    assert layer.length == 0  # nothing counted
    cache = KernelCache()
    with pytest.raises(ka.InputError, match=r"^past_key_values: "):
        cache.update(k, k, 0)


def test_a_converted_call_that_fails_before_its_update_leaves_the_layer_disarmed() -> None:
    converted = convert_attention(_llama(), "prf", num_features=8, seed=0)
    attention = converted_modules(converted)[0][1]
    cache = transformers.DynamicCache()
    wrong_width = torch.zeros(1, 3, 7, dtype=torch.float64)  # the model is 16 wide: q_proj fails
    with pytest.raises(RuntimeError):
        attention(wrong_width, None, None, cache=cache)
    layer = cache.layers[0]
    assert isinstance(layer, KernelStateLayer) and layer.armed is False
    with pytest.raises(ka.InputError, match=r"^past_key_values: "):
        cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)


def test_a_bert_decoder_still_decodes_on_its_state() -> None:
    """The encoder wrapper (convert/hf.py) takes the state layer and updates it itself."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        is_decoder=True, pad_token_id=0,
    )  # fmt: skip
    model = transformers.BertLMHeadModel(config).to(torch.float64).eval()
    converted = convert_attention(model, "softmax")
    ids = _padded(7)["input_ids"][:1]
    with torch.no_grad():
        past = converted(ids[:, :6], use_cache=True).past_key_values
        step = converted(ids[:, 6:], cache=past, use_cache=True).logits[:, -1]
        full = model(ids, use_cache=False).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-10, atol=1e-10)
    with torch.no_grad(), pytest.raises(ka.InputError, match=r"^past_key_values: "):
        model(ids[:, 6:], cache=past, use_cache=True)


# ---------------------------------------------------------------------- 3. Mixtral's router flag
def test_mixtral_converts_exactly_and_generates() -> None:
    """Every Mixtral forward was refused: its attention passes ``output_router_logits``."""
    base = _mixtral()
    converted = convert_attention(base, "softmax")
    inputs = _padded()
    keep = inputs["attention_mask"].bool()
    with torch.no_grad():
        for flag in (None, True):
            ours = converted(**inputs, output_router_logits=flag)
            theirs = base(**inputs, output_router_logits=flag)
            torch.testing.assert_close(ours.logits[keep], theirs.logits[keep], rtol=1e-5, atol=1e-5)
        assert ours.aux_loss is not None
        torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, rtol=1e-5, atol=1e-5)
    kw = {"max_new_tokens": 5, "do_sample": False}
    assert torch.equal(converted.generate(**inputs, **kw), base.generate(**inputs, **kw))
    _scores_equal_full_forward(convert_attention(base, "prf", num_features=8, seed=0), inputs)


# ---------------------------------------------------------------------- 4. GPT-NeoX's head_size
@pytest.mark.parametrize("rotary_pct", [None, 0.5, 1.0])
def test_gpt_neox_converts_exactly_and_generates(rotary_pct: float | None) -> None:
    """GPT-NeoX (Pythia) names its head width ``head_size``: conversion was refused."""
    base = _gpt_neox(**({} if rotary_pct is None else {"rotary_pct": rotary_pct}))
    expected = 0.25 if rotary_pct is None else rotary_pct  # 0.25: GPT-NeoX's default partial rotary
    assert base.config.rope_parameters["partial_rotary_factor"] == expected
    converted = convert_attention(base, "softmax")
    assert len(converted_modules(converted)) == 2
    inputs = _padded()
    keep = inputs["attention_mask"].bool()
    with torch.no_grad():
        ours, theirs = converted(**inputs).logits, base(**inputs).logits
    torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-5, atol=1e-5)
    kw = {"max_new_tokens": 5, "do_sample": False}
    assert torch.equal(converted.generate(**inputs, **kw), base.generate(**inputs, **kw))
    _scores_equal_full_forward(convert_attention(base, "prf", num_features=8, seed=0), inputs)


def test_head_dim_option_of_gpt_neox_is_checked_against_head_size() -> None:
    with pytest.raises(ka.InputError, match=r"^head_dim: .*heads of width 4, got head_dim=8"):
        convert_attention(_gpt_neox(), "prf", num_features=8, head_dim=8)


# ---------------------------------------------------------------------- 5. bidirectional masks, --help
def test_a_bidirectional_mask_with_a_decoding_state_names_use_cache() -> None:
    """A plain forward makes a cache (``use_cache`` defaults to True); the message said
    only "decoding with a state is causal"."""
    base = _llama()
    converted = convert_attention(base, "softmax")
    ids = _padded()["input_ids"][:1]
    everything = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool)
    with torch.no_grad():
        with pytest.raises(ka.InputError, match=r"^attention_mask: .*bidirectional") as info:
            converted(ids, attention_mask=everything)
        assert "use_cache defaults to True" in str(info.value) and "use_cache=False" in str(info.value)
        # the alternative the message names is true: without a state the mask is honoured
        ours = converted(ids, attention_mask=everything, use_cache=False).logits
        theirs = base(ids, attention_mask=everything, use_cache=False).logits
        causal = base(ids, use_cache=False).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    assert (ours - causal).abs().max() > 1e-3  # the mask is bidirectional indeed


def test_one_new_position_with_a_4d_mask_row_continues_the_state() -> None:
    """One query attends every key so far: its 4-D mask row (all ones, as any causal mask's
    last row) was read as bidirectional and refused."""
    converted = convert_attention(_llama(), "prf", num_features=8, seed=0)
    ids = _padded()["input_ids"][:1]
    n = ids.shape[1]
    with torch.no_grad():
        past = converted(ids[:, :-1], use_cache=True).past_key_values
        row = torch.ones(1, 1, 1, n, dtype=torch.bool)
        step = converted(ids[:, -1:], cache=past, attention_mask=row).logits[:, -1]
        full = converted(ids, use_cache=False).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-9, atol=1e-9)


def test_convert_help_describes_the_decoder_stages() -> None:
    from kernelattn_core.cli.main import build_parser

    parser = build_parser(["convert"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["convert"].format_help().split())
    decoder = text[text.index("A local decoder checkpoint") :]
    decoder = decoder[: decoder.index("--save DIR")]
    assert "(stage 1)" not in decoder
    assert "--e2e-steps" in decoder and "--lora-rank" in decoder and "next-token" in decoder
