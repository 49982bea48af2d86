"""Hugging Face decoders (GPT-2, Llama, Mistral, Qwen2) converted through transformers'
attention and mask interfaces, decoding on a constant-size state, saving and loading.

Tiny random-weight models are built offline from each family's config (2 layers, width
16, grouped-query attention for the Llama family). CI cost: about 40 s.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.convert import KernelDecoderAttention, convert_attention, converted_modules, from_pretrained

transformers = pytest.importorskip("transformers")

from kernelattn_core.convert.cache import KernelCache, KernelStateLayer  # noqa: E402

FAMILIES = ("gpt2", "llama", "mistral", "qwen2")
REG = ka.get_registry()
CAUSAL_NAMES = sorted(
    e.name
    for e in REG.entries()
    if e.kind in ("estimator", "feature_map", "kernel") and getattr(e.cls, "supports_causal", True)
)
#: the estimators whose ``step`` keeps a constant-size state
STATEFUL = sorted(
    n for n in CAUSAL_NAMES if REG.get(n).kind == "feature_map" or callable(getattr(REG.get(n).cls, "step", None))
)


def tiny(family: str, attn: str = "sdpa", dtype: torch.dtype = torch.float64, **extra: Any) -> Any:
    torch.manual_seed(0)
    common = {"vocab_size": 40, "attn_implementation": attn, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=64, **common, **extra)
        model = transformers.GPT2LMHeadModel(config)
    else:
        sizes = {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,  # grouped-query attention: 2 key/value heads serve 4 query heads
            "max_position_embeddings": 64,
        }
        config_cls, model_cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        }[family]
        model = model_cls(config_cls(**sizes, **common, **extra))
    model.generation_config.eos_token_id = None  # generate the requested number of tokens
    return model.to(dtype).eval()


def batch(n: int = 9) -> dict[str, torch.Tensor]:
    """Three sequences, the last two left-padded (as generate() pads)."""
    ids = torch.randint(3, 40, (3, n), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, n, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :5] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask}


def options(name: str) -> dict[str, Any]:
    entry = REG.get(name)
    opts: dict[str, Any] = {}
    if getattr(entry.cls, "has_budget", False) and entry.kind != "kernel":
        opts["num_features"] = 8
    if getattr(entry.cls, "random", False) and entry.kind != "kernel":
        opts["seed"] = 0
    if name == "sliding-window":
        opts["window"] = 2
    return opts


def generate(model: Any, inputs: dict[str, torch.Tensor], new: int = 5, **kw: Any) -> Any:
    return model.generate(**inputs, max_new_tokens=new, do_sample=False, **kw)


# ---------------------------------------------------------------------- conversion with exact attention
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("attn", "dtype"), [("sdpa", torch.float64), ("eager", torch.float32)])
def test_exact_conversion_equals_the_original(family: str, attn: str, dtype: torch.dtype) -> None:
    model = tiny(family, attn, dtype)
    converted = convert_attention(model, "softmax")
    mods = converted_modules(converted)
    assert len(mods) == 2 and all(isinstance(m, KernelDecoderAttention) for _, m in mods)
    original_class = type(model.get_submodule(mods[0][0]))
    assert isinstance(mods[0][1], original_class) and original_class.__name__.endswith("Attention")
    assert not converted_modules(model) and model.config._attn_implementation == attn  # original untouched
    assert converted.config._attn_implementation == "kernelattn"
    assert set(model.state_dict()) < set(converted.state_dict())  # every pretrained key kept, plus the estimators'
    inputs = batch()
    valid = inputs["attention_mask"].bool()
    with torch.no_grad():
        ref = model(**inputs).logits
        out = converted(**inputs).logits
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(out[valid], ref[valid], rtol=tol, atol=tol)
    assert torch.equal(generate(converted, inputs), generate(model, inputs))


def test_gpt2_layer_scaled_attention_converts_exactly() -> None:
    """GPT-2's scale_attn_by_inverse_layer_idx scales layer i's logits by 1/(i + 1): the
    converted estimator takes the module's scale."""
    model = tiny("gpt2", scale_attn_by_inverse_layer_idx=True)
    converted = convert_attention(model, "softmax")
    assert converted_modules(converted)[1][1].estimator.scale == pytest.approx(8**-0.5 / 2)  # d = 8, layer 1
    inputs = batch()
    valid = inputs["attention_mask"].bool()
    with torch.no_grad():
        torch.testing.assert_close(converted(**inputs).logits[valid], model(**inputs).logits[valid])


def test_padded_positions_never_reach_an_output() -> None:
    """NaN embeddings at left-padded positions: the converted model's valid outputs are
    unchanged (the original softmax model turns them NaN: 0 * NaN in its weights)."""
    model = tiny("llama")
    inputs = batch()
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    poisoned = embeds.masked_fill(~inputs["attention_mask"].bool()[..., None], float("nan"))
    valid = inputs["attention_mask"].bool()
    for name in ("softmax", "prf", "sliding-window"):
        converted = convert_attention(model, name, **options(name))
        with torch.no_grad():
            a = converted(inputs_embeds=embeds, attention_mask=inputs["attention_mask"]).logits
            b = converted(inputs_embeds=poisoned, attention_mask=inputs["attention_mask"]).logits
        assert torch.isfinite(b[valid]).all(), name
        torch.testing.assert_close(b[valid], a[valid], rtol=0, atol=0)


# ---------------------------------------------------------------------- every estimator
@pytest.mark.parametrize("name", CAUSAL_NAMES)
def test_every_estimator_runs_forward_backward_and_generate(name: str) -> None:
    model = tiny("llama", dtype=torch.float32)
    converted = convert_attention(model, name, **options(name)).train()
    inputs = batch()
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    loss = converted(**inputs, labels=labels).loss
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in converted.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    assert all(g is None or torch.isfinite(g).all() for g in grads)
    q_proj = converted.model.layers[0].self_attn.q_proj.weight.grad
    assert q_proj is not None and q_proj.abs().sum() > 0  # the estimator's inputs are differentiated
    converted.eval()
    out = generate(converted, inputs, new=3)
    assert out.shape == (3, 12)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("name", ["softmax", "prf"])
def test_converted_decoders_run_under_bf16_autocast(family: str, name: str) -> None:
    """Under autocast Llama's rotary embedding gives float32 queries and keys beside
    bfloat16 values (the estimator refused the mix); softmax stays close to the original."""
    model = tiny(family, dtype=torch.float32)
    converted = convert_attention(model, name, **options(name))
    inputs = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        out = converted(**inputs).logits
        ref = model(**inputs).logits
        generated = generate(converted, inputs, 3)
    assert torch.isfinite(out).all() and generated.shape == (3, inputs["input_ids"].shape[1] + 3)
    if name == "softmax":
        keep = inputs["attention_mask"].bool()
        torch.testing.assert_close(out.float()[keep], ref.float()[keep], rtol=0.05, atol=0.05)


def test_non_causal_estimators_are_refused_for_decoders() -> None:
    with pytest.raises(ka.InputError, match="estimator: 'lara' is non-causal only"):
        convert_attention(tiny("gpt2"), "lara", num_features=8)


# ---------------------------------------------------------------------- decoding on the state
def _scores_equal_full_forward(model: Any, inputs: dict[str, torch.Tensor], new: int = 6) -> None:
    out = generate(model, inputs, new=new, output_scores=True, return_dict_in_generate=True)
    seq = out.sequences
    mask = torch.cat([inputs["attention_mask"], torch.ones(3, new, dtype=torch.long)], 1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate() numbers left-padded rows
    with torch.no_grad():
        full = model(input_ids=seq, attention_mask=mask, position_ids=positions).logits  # no cache: causal forward
    n = inputs["input_ids"].shape[1]
    for t, scores in enumerate(out.scores):
        # generate() hands out float32 scores; the model runs in float64
        torch.testing.assert_close(scores.double(), full[:, n - 1 + t], rtol=1e-6, atol=1e-7)
    assert torch.equal(seq[:, n:], full[:, n - 1 : -1].argmax(-1))  # greedy tokens, token for token


@pytest.mark.parametrize("name", STATEFUL)
def test_greedy_generation_equals_the_full_causal_forward(name: str) -> None:
    model = convert_attention(tiny("llama"), name, **options(name))
    _scores_equal_full_forward(model, batch())
    out = generate(model, batch(), new=2, return_dict_in_generate=True)
    assert all(isinstance(layer, KernelStateLayer) and layer.state is not None for layer in out.cache.layers)
    assert not any(hasattr(layer.state, "k") for layer in out.cache.layers)  # no key-value cache


@pytest.mark.parametrize("family", ["gpt2", "mistral", "qwen2"])
def test_greedy_generation_equals_the_full_forward_in_every_family(family: str) -> None:
    _scores_equal_full_forward(convert_attention(tiny(family), "hedgehog", num_features=8), batch())


def test_estimators_without_a_step_decode_on_a_key_value_cache() -> None:
    model = convert_attention(tiny("llama"), "ra", num_features=8, seed=0)
    out = generate(model, batch(), new=2, return_dict_in_generate=True)
    state = out.cache.layers[0].state
    assert isinstance(state, ka.module.KVCache) and state.length == 9 + 1  # grows: no constant-size state
    _scores_equal_full_forward(convert_attention(tiny("llama"), "softmax"), batch())


@pytest.mark.parametrize("name", ["prf", "hedgehog", "sliding-window"])
def test_decoding_memory_does_not_grow_with_the_context(name: str) -> None:
    model = convert_attention(tiny("llama", dtype=torch.float32), name, **options(name))
    original = tiny("llama", dtype=torch.float32)
    sizes, kv = [], []
    for n in (8, 48):
        ids = torch.randint(3, 40, (1, n), generator=torch.Generator().manual_seed(n))
        cache = KernelCache()
        generate(model, {"input_ids": ids}, new=4, cache=cache)
        assert cache.get_seq_length() == n + 3
        sizes.append(cache.nbytes())
        out = generate(original, {"input_ids": ids}, new=4, return_dict_in_generate=True)
        kv.append(sum(layer.keys.numel() + layer.values.numel() for layer in out.cache.layers))
    assert sizes[0] == sizes[1] > 0
    assert kv[1] * (8 + 3) == kv[0] * (48 + 3)  # the original's key-value cache grows with the context


def test_a_kernel_cache_passed_in_decodes_like_the_default_one() -> None:
    model = convert_attention(tiny("gpt2"), "prf", num_features=8, seed=0)
    inputs = batch()
    cache = KernelCache()
    assert torch.equal(generate(model, inputs, cache=cache), generate(model, inputs))
    assert cache.get_seq_length() == 13 and isinstance(cache.layers[0].state, ka.engine.torch_backend.CausalState)


def test_beam_search_reorders_the_states() -> None:
    model = convert_attention(tiny("llama"), "elu")
    inputs = batch()
    beams = model.generate(**inputs, max_new_tokens=4, num_beams=3, do_sample=False)
    assert beams.shape == (3, 13)
    with torch.no_grad():  # the best beam's tokens are the model's argmax continuation or scored higher
        assert torch.isfinite(model(input_ids=beams, attention_mask=torch.ones_like(beams)).logits).all()


def test_foreign_and_static_caches_are_refused() -> None:
    original = tiny("llama")
    converted = convert_attention(original, "prf", num_features=8, seed=0)
    filled = generate(original, batch(), new=1, return_dict_in_generate=True).cache
    with pytest.raises(ka.InputError, match="cache: layer 0 of the DynamicCache holds keys and values already"):
        converted(input_ids=torch.ones(3, 1, dtype=torch.long), cache=filled)
    with pytest.raises(ka.InputError, match="cache: layer 0 of the StaticCache is a StaticLayer"):
        generate(converted, batch(), new=2, cache_implementation="static")


def test_a_binding_sliding_window_of_the_original_is_refused_not_ignored() -> None:
    model = tiny("mistral", sliding_window=4)
    converted = convert_attention(model, "prf", num_features=8, seed=0)
    with pytest.raises(ka.InputError, match=r"attention_mask: .*config.sliding_window = 4 binds"):
        converted(**batch())
    converted.config.sliding_window = None  # every earlier token attended, on purpose
    with torch.no_grad():
        assert torch.isfinite(converted(**batch()).logits).all()


# ---------------------------------------------------------------------- saving and loading
def _fitted(name: str, family: str = "gpt2") -> Any:
    model = convert_attention(tiny(family), name, **options(name))
    with torch.no_grad():  # learned parameters away from their initial values
        for _, module in converted_modules(model):
            for p in module.estimator.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize(("name", "family"), [("hedgehog", "gpt2"), ("prf", "llama"), ("sliding-window", "qwen2")])
def test_save_pretrained_round_trip_rebuilds_the_estimators(tmp_path, name: str, family: str) -> None:
    model = _fitted(name, family)
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path)
    assert loaded.config.kernelattn["estimator"] == name and loaded.config._attn_implementation == "kernelattn"
    inputs = batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)
    assert torch.equal(generate(loaded, inputs), generate(model, inputs))
    # another estimator's folder is rebuilt as that estimator, not as this one
    assert type(converted_modules(loaded)[0][1].estimator) is type(converted_modules(model)[0][1].estimator)


def test_plain_auto_model_loading_of_a_converted_folder_is_not_silently_softmax(tmp_path) -> None:
    model = _fitted("hedgehog")
    model.save_pretrained(tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert plain.config._attn_implementation == "kernelattn"
    with pytest.raises(ka.InputError, match="kernelattn_core.convert.from_pretrained"):
        plain(**batch())


def test_from_pretrained_refuses_a_folder_without_a_conversion(tmp_path) -> None:
    tiny("gpt2").save_pretrained(tmp_path)
    with pytest.raises(ka.InputError, match="holds no kernelattn conversion"):
        from_pretrained(tmp_path)


def test_torch_save_of_the_state_dict_and_of_the_whole_model() -> None:
    model = _fitted("hedgehog", "llama")
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    again = convert_attention(tiny("llama"), "hedgehog", num_features=8)
    again.load_state_dict(torch.load(buffer))
    inputs = batch()
    with torch.no_grad():
        ref = model(**inputs).logits
        torch.testing.assert_close(again(**inputs).logits, ref, rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the swapped classes pickle by their transformers base
    buffer.seek(0)
    whole = torch.load(buffer, weights_only=False)
    assert isinstance(whole.model.layers[0].self_attn, KernelDecoderAttention)
    with torch.no_grad():
        torch.testing.assert_close(whole(**inputs).logits, ref, rtol=0, atol=0)
