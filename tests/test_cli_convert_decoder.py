"""``kernelattn convert`` on a local decoder checkpoint (issue 24): detected from its
config, fitted, reported by held-out perplexity of teacher and student, saved with
``save_pretrained``; bad arguments refused in one line before any work. And the
end-to-end stage for decoders (:func:`kernelattn_core.convert.lm.finetune_causal_lm`).

The teacher is the project's byte-level GPT-2 in its ``tiny`` size, trained for 30 steps
(its perplexities mean nothing; the figures are compared with what the library computes
on the same tokens). CI cost: about 20 s.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import kernelattn_core as ka
from kernelattn_core.cli.main import main
from kernelattn_core.convert import converted_modules, from_pretrained, lm, teacher
from kernelattn_core.errors import InputError
from kernelattn_core.workloads import minilm

CONTEXT = 64


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("decoder") / "teacher"
    args = ["--output", str(out), "--size", "tiny", "--steps", "30", "--context", str(CONTEXT), "--lr", "1e-2"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert teacher.main(args) == 0
    return out


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own errors
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_a_decoder_is_converted_fitted_reported_by_perplexity_and_saved(teacher_dir: Path, tmp_path: Path) -> None:
    saved = tmp_path / "student"
    code, out, err = run_cli(
        ["convert", str(teacher_dir), "--estimator", "hedgehog", "--budget", "8", "--steps", "6", "--rows", "16",
         "--fit-sequences", "4", "--eval-texts", "held-out", "narrative", "--eval-sequences", "2",
         "--format", "json", "--save", str(saved), "--no-progress"]
    )  # fmt: skip
    assert code == 0, err
    records = json.loads(out)
    layers = [r for r in records if "layer" in r]
    texts = {r["text"]: r for r in records if "text" in r}
    summary = records[-1]
    assert summary["summary"] and summary["architecture"] == "GPT2LMHeadModel"
    assert summary["max_length"] == CONTEXT  # the context of the folder's teacher.json
    assert len(layers) == 2 and all(r["fit_error_after"] < r["fit_error_before"] for r in layers)
    # the reported perplexities are the library's on the same tokens: the teacher's own ...
    model, tok = lm.load_decoder(teacher_dir)
    for name in ("held-out", "narrative"):
        packed = lm.pack_causal(tok, minilm.read_texts(name), max_length=CONTEXT, max_sequences=2)
        assert texts[name]["sequences"] == 2 and texts[name]["tokens"] == int(packed["attention_mask"][:, 1:].sum())
        assert texts[name]["teacher_perplexity"] == pytest.approx(lm.perplexity(model, packed), rel=1e-6)
    # ... and the saved student's, which reloads converted (from_pretrained) with the same figure
    student = from_pretrained(saved)
    assert student.config.kernelattn["estimator"] == "hedgehog"
    assert all(type(m).__name__.startswith("Kernel") for _, m in converted_modules(student))
    packed = lm.pack_causal(tok, minilm.read_texts("held-out"), max_length=CONTEXT, max_sequences=2)
    assert texts["held-out"]["student_perplexity"] == pytest.approx(lm.perplexity(student, packed), rel=1e-6)
    with torch.no_grad():  # the student is what was measured: its logits are not the teacher's (exact: ~1e-7)
        assert (student(**packed).logits - model(**packed).logits).abs().max() > 1e-5
    ratio = texts["held-out"]["student_perplexity"] / texts["held-out"]["teacher_perplexity"]
    assert summary["ratio"] == pytest.approx(ratio, rel=1e-12)
    assert summary["max_ratio"] == pytest.approx(max(t["ratio"] for t in texts.values()), rel=1e-12)
    assert (saved / "tokenizer_config.json").is_file()  # lm.load_decoder reads the folder alone
    again, _ = lm.load_decoder(saved)
    assert lm.perplexity(again, packed) == pytest.approx(texts["held-out"]["student_perplexity"], rel=1e-6)


def test_exact_attention_reports_the_teachers_perplexity_table_and_progress(
    teacher_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELATTN_PROGRESS", "1")
    code, out, err = run_cli(
        ["convert", str(teacher_dir), "--estimator", "softmax", "--steps", "0", "--eval-texts", "legal",
         "--eval-sequences", "3"]
    )  # fmt: skip
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("legal"))
    teacher_ppl, student_ppl, ratio = (float(x) for x in row.split()[3:6])
    assert teacher_ppl == pytest.approx(student_ppl, rel=1e-4) and ratio == pytest.approx(1.0, abs=1e-4)
    assert "perplexity ratio       1.0000" in out
    assert "loading the decoder" in err and "evaluation: perplexity on 'legal' (3 sequences)" in err


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_work(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(lm, "load_decoder", no_work)


@pytest.mark.parametrize(
    ("extra", "argument"),
    [
        (["--sentences", "10"], "--sentences"),  # encoder-only options on a decoder: refused, not ignored
        (["--passages", "4"], "--passages"),
        (["--allocate", "64"], "--allocate"),
        (["--allocate-heavy", "0,32"], "--allocate-heavy"),
        (["--e2e-length", "128"], "--e2e-length"),
        (["--max-length", "1000"], "--max-length"),  # the tiny teacher has 256 positions
        (["--estimator", "lara"], "--estimator"),  # non-causal only
        (["--save", "FILE"], "--save"),  # an existing file, where a folder is written
        (["--save", "MISSING/deeper/student"], "--save"),
        (["--eval-texts", "MISSING/none.txt"], "--eval-texts"),
    ],
)
def test_bad_decoder_arguments_are_one_line_before_any_work(
    teacher_dir: Path, tmp_path: Path, no_loading: None, extra: list[str], argument: str
) -> None:
    (tmp_path / "file.txt").write_text("x")
    extra = [a.replace("FILE", str(tmp_path / "file.txt")).replace("MISSING", str(tmp_path / "no")) for a in extra]
    argv = ["convert", str(teacher_dir), "--estimator", "hedgehog", "--steps", "1", "--no-progress"]
    code, _, err = run_cli([*argv, *extra])
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("usage:", " "))]
    assert code == 2 and len(lines) == 1, err
    assert "error:" in lines[0] and argument in lines[0], lines[0]


def test_folders_that_are_not_a_decoder_to_convert_are_refused(
    teacher_dir: Path, tmp_path: Path, no_loading: None
) -> None:
    argv = ["convert", "FOLDER", "--estimator", "hedgehog", "--no-progress"]
    code, _, err = run_cli([a.replace("FOLDER", str(tmp_path / "nope")) for a in argv])
    assert code == 2 and "model folder with config.json" in err
    bare = tmp_path / "bare"  # a decoder saved without its tokenizer
    bare.mkdir()
    (bare / "config.json").write_text((teacher_dir / "config.json").read_text())
    code, _, err = run_cli([a.replace("FOLDER", str(bare)) for a in argv])
    assert code == 2 and "no tokenizer" in err
    done = tmp_path / "done"  # a converted one: convert the original instead
    done.mkdir()
    config = json.loads((teacher_dir / "config.json").read_text())
    (done / "config.json").write_text(json.dumps({**config, "kernelattn": {"estimator": "prf", "options": {}}}))
    code, _, err = run_cli([a.replace("FOLDER", str(done)) for a in argv])
    assert code == 2 and "converted already" in err


def test_is_decoder_config_tells_decoders_from_encoders() -> None:
    from kernelattn_core.cli.convert_decoder import is_decoder_config

    assert is_decoder_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert is_decoder_config({"architectures": ["Qwen2ForCausalLM"]})
    assert is_decoder_config({"model_type": "llama"})
    assert not is_decoder_config({"architectures": ["BertModel"], "model_type": "bert"})
    assert not is_decoder_config({"architectures": ["BertLMHeadModel"], "model_type": "bert"})
    assert not is_decoder_config({"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True})


# ---------------------------------------------------------------------- the end-to-end stage
def _tiny_pair(family: str) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    torch.manual_seed(0)
    # weights far larger than the usual 0.02: peaked attention and next-token distributions, so the
    # converted model starts measurably away from the original (at 0.02 the KL starts at 3e-10)
    peaked = {"initializer_range": 0.5}
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=64, **peaked)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, **peaked,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    model = model.double().eval()
    ids = torch.randint(3, 40, (6, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[-1, 20:] = 0
    student = ka.convert_attention(model, "hedgehog", num_features=4)
    return model, student, {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_end_to_end_stage_lowers_the_kl_and_merges_its_adapters(family: str) -> None:
    teacher_model, student, batch = _tiny_pair(family)
    keys = set(student.state_dict())
    before = {k: v.clone() for k, v in student.state_dict().items()}
    report = lm.finetune_causal_lm(
        student, teacher_model, batch, steps=12, lr=2e-2, batch_size=3, lora_rank=2, eval_every=4
    )
    assert report.parameters > 0 and report.lora_rank == 2
    assert report.loss_after < report.loss_before  # the kept step is better than the start
    with torch.no_grad():
        kl = lm.causal_kl(
            student(**batch).logits, teacher_model(**batch).logits, batch["attention_mask"]
        )  # validation = the batch here: the reported loss is the model's now
    assert float(kl) == pytest.approx(report.loss_after, rel=1e-9)
    assert set(student.state_dict()) == keys  # adapters merged: the state dict keeps its keys
    assert not any(isinstance(m, lm.LoRAProjection) for m in student.modules())
    proj = "transformer.h.0.attn.c_attn.weight" if family == "gpt2" else "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(student.state_dict()[proj], before[proj])  # the adapter moved the projection
    assert torch.equal(student.state_dict()["lm_head.weight"], before["lm_head.weight"])  # frozen
    for p in teacher_model.parameters():
        assert p.grad is None


def test_lora_projection_merges_to_the_same_function() -> None:
    from transformers.pytorch_utils import Conv1D

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    for base in (torch.nn.Linear(8, 6).double(), Conv1D(6, 8).double()):
        wrapped = lm.LoRAProjection(base, 2, 2.0, gen)
        torch.nn.init.normal_(wrapped.lora_b)
        want = wrapped(x).detach()
        assert not torch.allclose(want, base(x))  # the adapter changes the function (negative control)
        merged = wrapped.merged()
        assert torch.allclose(merged(x), want, atol=1e-12)


def test_causal_kl_ignores_padded_positions_whatever_they_hold() -> None:
    s, t = torch.randn(2, 5, 7), torch.randn(2, 5, 7)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    want = lm.causal_kl(s, t, mask)
    s2 = s.clone().requires_grad_(True)
    with torch.no_grad():
        s2[1, 3:] = float("nan")
    got = lm.causal_kl(s2, t, mask)
    got.backward()
    assert torch.equal(got.detach(), want) and torch.isfinite(s2.grad).all()
    assert (s2.grad[1, 3:] == 0).all()
    assert lm.causal_kl(t, t, mask).abs() < 1e-6 and want > 0
    assert math.isnan(float(lm.causal_kl(s2.detach(), t)))  # without the mask the NaN counts (negative control)


def test_the_end_to_end_stage_refuses_what_it_cannot_train() -> None:
    teacher_model, _, batch = _tiny_pair("gpt2")
    plain = ka.convert_attention(teacher_model, "elu")  # no parameters
    with pytest.raises(InputError, match="nothing to train"):
        lm.finetune_causal_lm(plain, teacher_model, batch, steps=2)
    with pytest.raises(InputError, match="no converted"):
        lm.finetune_causal_lm(teacher_model, teacher_model, batch, steps=2)
    with pytest.raises(InputError, match="batch"):
        lm.finetune_causal_lm(plain, teacher_model, {"input_ids": batch["input_ids"]}, steps=2, lora_rank=1)
