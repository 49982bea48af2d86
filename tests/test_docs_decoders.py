"""The code blocks of the decoder section of docs/real_models.rst run as pasted, in order,
and print what their comments say; its console block (``kernelattn convert`` on the tiny
teacher the blocks before saved) runs through the command's entry point.
CI cost: about 25 s (tiny models, a few steps)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

PAGE = Path(__file__).resolve().parents[1] / "docs" / "real_models.rst"


def decoder_blocks() -> list[str]:
    """The ``.. code-block:: python`` bodies of the section that starts at ``.. _decoders:``."""
    text = PAGE.read_text("utf-8")
    section = text[text.index(".. _decoders:") :]
    blocks = []
    for match in re.finditer(r"^\.\. code-block:: python\n\n((?:(?:   .*)?\n)+)", section, flags=re.M):
        blocks.append(textwrap.dedent(match.group(1)))
    return blocks


def console_commands() -> list[str]:
    """The ``$ kernelattn ...`` lines of the section's ``.. code-block:: console`` blocks."""
    text = PAGE.read_text("utf-8")
    section = text[text.index(".. _decoders:") :]
    found = []
    for match in re.finditer(r"^\.\. code-block:: console\n\n((?:(?:   .*)?\n)+)", section, flags=re.M):
        found += [line.strip()[2:] for line in match.group(1).splitlines() if line.strip().startswith("$ ")]
    return found


def test_the_section_has_its_blocks() -> None:
    blocks = decoder_blocks()
    assert len(blocks) == 5
    assert "convert_attention(llama" in blocks[0] and "torch.compile" in blocks[-1]


def test_decoder_code_blocks_run_as_pasted(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # save_pretrained("student") writes here
    namespace: dict[str, object] = {"__name__": "__docs__"}
    printed = []
    for block in decoder_blocks():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, str(PAGE), "exec"), namespace)  # the documented code itself
        printed.append(out.getvalue().strip())
    # the console block, on the teacher the blocks saved; then its output as the page shows it
    (command,) = console_commands()
    words = shlex.split(command)
    assert words[0] == "kernelattn"
    from kernelattn_core.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(words[1:]) == 0
    shown = [line for line in out.getvalue().splitlines() if line.startswith(("hedgehog", "perplexity ratio", "saved"))]
    assert shown[0].startswith("hedgehog {'num_features': 16} on teacher (GPT2LMHeadModel)")
    assert shown[-1].split() == ["saved", "student-cli"]
    assert (tmp_path / "student-cli" / "config.json").is_file()
    assert json.loads((tmp_path / "student-cli" / "config.json").read_text())["kernelattn"]["estimator"] == "hedgehog"
    assert printed[0] == "True torch.Size([2, 32])"
    assert printed[1] == "True"
    assert printed[2] == "True"
    teacher_ppl, student_ppl = (float(x) for x in printed[3].split())
    assert 1.0 < teacher_ppl < 400 and 1.0 < student_ppl < 400
    assert (tmp_path / "student" / "config.json").is_file()
