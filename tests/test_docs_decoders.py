"""The code blocks of the decoder section of docs/real_models.rst run as pasted, in order,
and print what their comments say. CI cost: about 15 s (tiny models, a few steps)."""

from __future__ import annotations

import contextlib
import io
import re
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
    assert printed[0] == "True torch.Size([2, 32])"
    assert printed[1] == "True"
    assert printed[2] == "True"
    teacher_ppl, student_ppl = (float(x) for x in printed[3].split())
    assert 1.0 < teacher_ppl < 400 and 1.0 < student_ppl < 400
    assert (tmp_path / "student" / "config.json").is_file()
