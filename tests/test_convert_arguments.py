"""Bad arguments of conversion are answered in one line, before any work.

* ``kernelattn convert``: every argument is checked before the model is loaded (the test
  makes loading fail loudly to prove it): a bad one ends the command with exit status 2
  and one line ``kernelattn: error: <argument>: ...`` (argparse's own one-line error for a
  value of the wrong type). Before (issue 25), 11 of 29 bad arguments printed a
  traceback (non-UTF-8 texts, a bad ``config.json``, ``--option seed=abc``, ``--device
  bogus`` / ``cuda`` without CUDA, ``--fit-sequences 0``, ``--eval-sequences 0``, and
  ``--output`` / ``--save`` into a missing folder, found only after the whole fit).
* :func:`~kernelattn_core.convert.convert_attention`: ``seed="abc"``, ``seed=1.5``,
  ``num_heads=3`` and a ``head_dim`` other than the model's are refused naming the
  option (they raised a raw ValueError, were truncated, raised a TypeError, or failed
  at the first forward call).

CI cost: about 5 s (no model is loaded).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch
from torch import nn

import kernelattn_core as ka
from kernelattn_core.cli.main import main
from kernelattn_core.convert import convert_attention


def _have_minilm() -> bool:
    try:
        from kernelattn_core.workloads import minilm

        minilm.model_dir()
    except Exception:
        return False
    return True


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "ok.txt").write_text("Some valid fitting text. It has several sentences for the model to read.\n")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 bytes \xff\xfe not utf8 here. Another sentence of words.\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("Too short.\n")
    (tmp_path / "badcfg").mkdir()
    (tmp_path / "badcfg" / "config.json").write_text("{not json")
    (tmp_path / "listcfg").mkdir()
    (tmp_path / "listcfg" / "config.json").write_text("[1, 2]")
    (tmp_path / "emptydir").mkdir()
    return tmp_path


#: name -> (arguments after the defaults, the argument the one-line error names)
BAD_CONVERT_ARGUMENTS: dict[str, tuple[list[str], str]] = {
    "model-missing": (["MODEL=nope"], "model"),
    "model-without-config": (["MODEL=emptydir"], "model"),
    "model-config-not-json": (["MODEL=badcfg"], "MODEL_DIR"),
    "model-config-not-an-object": (["MODEL=listcfg"], "MODEL_DIR"),
    "estimator-unknown": (["ESTIMATOR=nope"], "unknown class name 'nope'"),
    "budget-zero": (["--budget", "0"], "--budget"),
    "budget-negative": (["--budget", "-4"], "--budget"),
    "budget-not-an-int": (["--budget", "abc"], "--budget"),
    "window-negative": (["--window", "-1", "ESTIMATOR=sliding-window"], "--window"),
    "option-without-equals": (["--option", "seed"], "--option"),
    "option-seed-abc": (["--option", "seed=abc", "ESTIMATOR=prf"], "seed"),
    "option-seed-float": (["--option", "seed=1.5", "ESTIMATOR=prf"], "seed"),
    "option-unknown": (["--option", "bogus=1"], "bogus"),
    "option-num-heads": (["--option", "num_heads=3"], "num_heads"),
    "fit-texts-missing": (["--fit-texts", "FILES/nope.txt"], "--fit-texts"),
    "fit-texts-not-utf8": (["--fit-texts", "FILES/latin1.txt"], "--fit-texts"),
    "fit-texts-empty": (["--fit-texts", "FILES/empty.txt"], "--fit-texts"),
    "eval-texts-missing": (["--eval-texts", "FILES/nope.txt"], "--eval-texts"),
    "eval-texts-not-utf8": (["--eval-texts", "FILES/latin1.txt"], "--eval-texts"),
    "eval-texts-without-a-sentence": (["--eval-texts", "FILES/short.txt"], "--eval-texts"),
    "steps-negative": (["--steps", "-1"], "--steps"),
    "lr-zero": (["--lr", "0"], "--lr"),
    "lr-nan": (["--lr", "nan"], "--lr"),
    "rows-zero": (["--rows", "0"], "--rows"),
    "max-length-2": (["--max-length", "2"], "--max-length"),
    "max-length-beyond-the-model": (["--max-length", "100000"], "--max-length"),
    "fit-sequences-zero": (["--fit-sequences", "0"], "--fit-sequences"),
    "eval-sequences-zero": (["--eval-sequences", "0"], "--eval-sequences"),
    "sentences-zero": (["--sentences", "0"], "--sentences"),
    "device-bogus": (["--device", "bogus"], "--device"),
    "device-cuda-without-cuda": (["--device", "cuda"], "--device"),
    "output-in-a-missing-folder": (["--output", "FILES/nofolder/report.txt"], "--output"),
    "save-in-a-missing-folder": (["--save", "FILES/nofolder/model.pt"], "--save"),
    "output-is-a-folder": (["--output", "FILES/emptydir"], "--output"),
    "dtype-not-a-choice": (["--dtype", "float16"], "--dtype"),
    # the stages of issue 28
    "passages-zero": (["--passages", "0"], "--passages"),
    "e2e-steps-negative": (["--e2e-steps", "-1"], "--e2e-steps"),
    "e2e-batch-zero": (["--e2e-batch", "0"], "--e2e-batch"),
    "e2e-length-2": (["--e2e-length", "2"], "--e2e-length"),
    "e2e-length-not-ints": (["--e2e-length", "128,x"], "--e2e-length"),
    "e2e-weight-negative": (["--e2e-weight", "-1"], "--e2e-weight"),
    "e2e-length-beyond-the-model": (["--e2e-length", "100000"], "--e2e-length"),
    "e2e-lr-zero": (["--e2e-lr", "0"], "--e2e-lr"),
    "lora-rank-negative": (["--lora-rank", "-1"], "--lora-rank"),
    "anchor-negative": (["--anchor", "-1"], "--anchor"),
    "allocate-windows-not-ints": (["--allocate-windows", "a,b"], "--allocate-windows"),
    "allocate-too-small": (["--allocate", "10", "--allocate-windows", "8"], "--allocate-windows"),
    "allocate-steps-zero": (["--allocate-steps", "0"], "--allocate-steps"),
    "allocate-heavy-not-ints": (["--allocate-heavy", "0,x"], "--allocate-heavy"),
    "allocate-heavy-without-allocate": (["--allocate-heavy", "0,32"], "--allocate-heavy: sets the candidates"),
    "allocate-steps-without-allocate": (["--allocate-steps", "10"], "--allocate-steps: sets the candidates"),
    "allocate-heavy-negative": (["--allocate-heavy", "-4"], "--allocate-heavy"),
    "allocate-heavy-twice": (["--allocate-heavy", "0,32", "--option", "heavy_keys=8"], "--allocate-heavy"),
    "allocate-heavy-too-many": (
        ["--allocate", "40", "--allocate-windows", "8", "--allocate-heavy", "30"],
        "--allocate",
    ),
    "eval-texts-second-missing": (["--eval-texts", "FILES/ok.txt", "FILES/nope.txt"], "--eval-texts"),
}


def _argv(extra: list[str], files: Path) -> list[str]:
    model, estimator = "minilm", "elu"
    rest = []
    for arg in extra:
        if arg.startswith("MODEL="):
            model = str(files / arg.removeprefix("MODEL="))
        elif arg.startswith("ESTIMATOR="):
            estimator = arg.removeprefix("ESTIMATOR=")
        else:
            rest.append(arg.replace("FILES", str(files)))
    ok = str(files / "ok.txt")
    return [
        "convert", model, "--estimator", estimator, "--steps", "0", "--max-length", "32", "--no-progress",
        "--fit-texts", ok, "--eval-texts", ok, *rest,
    ]  # fmt: skip


@pytest.mark.parametrize("kind", sorted(BAD_CONVERT_ARGUMENTS))
def test_a_bad_convert_argument_is_one_line_before_any_work(kind: str, files: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    extra, argument = BAD_CONVERT_ARGUMENTS[kind]
    if kind == "device-cuda-without-cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if not kind.startswith("model-") and not _have_minilm():
        pytest.skip("needs the shipped MiniLM (its config.json is read)")
    from kernelattn_core.workloads import minilm

    def no_work(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(minilm, "load_model", no_work)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(_argv(extra, files))
        except SystemExit as exc:  # argparse: usage line, then its one-line error
            code = exc.code
    lines = [line for line in err.getvalue().splitlines() if line.strip() and not line.startswith(("usage:", " "))]
    assert code == 2, err.getvalue()
    assert len(lines) == 1, err.getvalue()
    assert "error:" in lines[0] and argument in lines[0], lines[0]


def test_the_catalogue_covers_the_issues_29_kinds() -> None:
    assert len(BAD_CONVERT_ARGUMENTS) >= 29


def _encoder() -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=32, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@pytest.mark.parametrize(
    ("options", "argument"),
    [
        ({"seed": "abc"}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"num_heads": 3}, "num_heads"),
        ({"embed_dim": 64}, "embed_dim"),
        ({"head_dim": 3}, "head_dim"),
        ({"causal": "no"}, "causal"),
    ],
)
def test_convert_attention_refuses_bad_options_naming_them(options: dict, argument: str) -> None:
    pytest.importorskip("kernelattn_prf")
    with pytest.raises(ka.InputError, match=f"^{argument}:"):
        convert_attention(_encoder(), "prf", num_features=8, **options)


def test_convert_attention_takes_the_models_own_head_dim_and_an_int_seed() -> None:
    pytest.importorskip("kernelattn_prf")
    model = convert_attention(_encoder(), "prf", num_features=8, head_dim=8, seed=4)
    seeds = [int(m.estimator.redraw_policy.seed) for m in (model.layers[0].self_attn, model.layers[1].self_attn)]
    assert seeds == [4, 5]
    x = torch.randn(2, 5, 32)
    assert model(x).shape == x.shape
