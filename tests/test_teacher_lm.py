"""The causal teacher (kernelattn_core.convert.teacher) and the language-model helpers
(kernelattn_core.convert.lm): packing, held-out perplexity, loading any local decoder.
CI cost: about 15 s (a tiny teacher trained for a few dozen steps)."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

import kernelattn_core as ka
from kernelattn_core.convert import lm, teacher
from kernelattn_core.errors import InputError

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def test_pack_causal_cuts_the_token_stream_and_pads_the_last_piece() -> None:
    tok = teacher.byte_tokenizer()
    packed = lm.pack_causal(tok, "abcdefghij", max_length=4)
    ids, mask = packed["input_ids"], packed["attention_mask"]
    assert ids.shape == mask.shape == (3, 4)
    stream = tok("abcdefghij", add_special_tokens=False)["input_ids"]
    assert ids[mask.bool()].tolist() == stream  # every byte once, in order
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert lm.pack_causal(tok, "abcdefghij", max_length=4, max_sequences=2)["input_ids"].shape == (2, 4)
    assert lm.pack_causal(tok, "abcdefghi", max_length=4)["input_ids"].shape == (2, 4)  # a lone last token is dropped
    with pytest.raises(InputError, match="max_length"):
        lm.pack_causal(tok, "abc", max_length=1)
    with pytest.raises(InputError, match="two tokens"):
        lm.pack_causal(tok, "a", max_length=4)


def test_perplexity_is_exp_of_the_mean_next_token_loss_over_real_tokens() -> None:
    tok = teacher.byte_tokenizer()
    model = teacher.teacher_model("tiny", vocab_size=len(tok)).eval()
    packed = lm.pack_causal(tok, TEXT[:150], max_length=64)
    assert packed["attention_mask"][-1].sum() < 64  # the last row is padded
    with torch.no_grad():
        logits = model(**packed).logits
    want, count = 0.0, 0
    for row in range(logits.shape[0]):
        n = int(packed["attention_mask"][row].sum())
        target = packed["input_ids"][row, 1:n]
        want += float(torch.nn.functional.cross_entropy(logits[row, : n - 1], target, reduction="sum"))
        count += n - 1
    assert math.isclose(lm.perplexity(model, packed, batch_size=1), math.exp(want / count), rel_tol=1e-6)
    # a padded position's token never counts (negative control: a real one does)
    changed = {k: v.clone() for k, v in packed.items()}
    changed["input_ids"][-1, -1] = 7
    assert lm.perplexity(model, changed) == pytest.approx(lm.perplexity(model, packed), rel=1e-12)
    changed["input_ids"][0, 5] = 7
    assert lm.perplexity(model, changed) != pytest.approx(lm.perplexity(model, packed), rel=1e-6)
    # a model that knows nothing (all logits 0) has the vocabulary's size as perplexity
    torch.nn.init.zeros_(model.lm_head.weight)
    assert lm.perplexity(model, packed) == pytest.approx(len(tok), rel=1e-6)
    with pytest.raises(InputError, match="no token"):
        lm.perplexity(model, [])


def test_a_tiny_teacher_learns_the_text_in_seconds(tmp_path) -> None:
    tok = teacher.byte_tokenizer()
    held_out = lm.pack_causal(tok, TEXT[7:400], max_length=64)
    untrained = lm.perplexity(teacher.teacher_model("tiny", vocab_size=len(tok)), held_out)
    model, tok, report = teacher.train_teacher(
        TEXT, size="tiny", context=64, batch_size=8, steps=60, minutes=None, lr=1e-2, eval_text=TEXT[7:400]
    )
    assert report.steps == 60 and report.parameters == sum(p.numel() for p in model.parameters())
    assert untrained > 200  # about the vocabulary (384): nothing learnt
    assert report.held_out_perplexity < untrained / 10  # a repeated sentence is learnt
    assert report.held_out_perplexity == pytest.approx(lm.perplexity(model, held_out), rel=1e-9)
    assert not model.training
    with pytest.raises(InputError, match="steps"):
        teacher.train_teacher(TEXT, size="tiny", context=64, steps=None, minutes=None)
    with pytest.raises(InputError, match="size"):
        teacher.teacher_model("huge")
    with pytest.raises(InputError, match="context"):
        teacher.train_teacher("short", size="tiny", context=64, steps=1)


def test_the_command_line_saves_a_folder_any_decoder_code_loads(tmp_path) -> None:
    fit, held = tmp_path / "fit.txt", tmp_path / "held.txt"
    fit.write_text(TEXT, "utf-8")
    held.write_text(TEXT[3:300], "utf-8")
    out = tmp_path / "teacher"
    args = ["--output", str(out), "--size", "tiny", "--steps", "6", "--context", "32", "--batch-size", "4"]
    assert teacher.main([*args, "--fit-texts", str(fit), "--eval-texts", str(held)]) == 0
    record = json.loads((out / "teacher.json").read_text("utf-8"))
    assert record["steps"] == 6 and record["size"] == "tiny"
    model, tok = lm.load_decoder(out)
    packed = lm.pack_causal(tok, TEXT[3:300], max_length=32)
    assert lm.perplexity(model, packed) == pytest.approx(record["held_out_perplexity"], rel=1e-5)
    # a converted student saved from it loads back converted, with the same perplexity
    student = ka.convert_attention(model, "prf", num_features=8, seed=0)
    student.save_pretrained(tmp_path / "student")
    tok.save_pretrained(tmp_path / "student")
    again, _ = lm.load_decoder(tmp_path / "student")
    assert type(again.transformer.h[0].attn) is type(student.transformer.h[0].attn)
    assert lm.perplexity(again, packed) == pytest.approx(lm.perplexity(student, packed), rel=1e-9)
    assert again.config.kernelattn["estimator"] == "prf"  # not reloaded as softmax attention
    with pytest.raises(InputError, match="config.json"):
        lm.load_decoder(tmp_path)
