"""Every ``.. code-block:: python`` of the docs runs as pasted.

The blocks of one page run in order in one namespace (a page's later blocks continue its
earlier ones, as a reader pasting them into one session would), in a temporary working
directory, with the global generator seeded. The decoder section of ``real_models.rst``
(from ``.. _decoders:`` on) runs in ``tests/test_docs_decoders.py``, which also checks what
its blocks print. A block that is not Python (a signature, a shell command) is a
``text`` or ``console`` block, not a ``python`` one. CI cost: about 40 s (the MiniLM
fitting example of ``real_models.rst`` is most of it).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: pages whose blocks from a label on are run by another test (page name -> label)
ELSEWHERE = {"real_models.rst": ".. _decoders:"}


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every ``.. code-block:: python`` in ``text`` (options such as
    ``:caption:`` skipped; the body is the indented lines after the directive, blank lines
    included, dedented)."""
    lines = text.split("\n")
    found, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)\.\. code-block:: python\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, j = len(m.group(1)), i + 1
        while j < len(lines) and lines[j].strip().startswith(":"):
            j += 1
        body = []
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
            body.append(lines[j])
            j += 1
        found.append((i + 1, textwrap.dedent("\n".join(body)).strip("\n")))
        i = j
    return found


def page_blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text("utf-8")
    label = ELSEWHERE.get(page.name)
    if label is not None:
        text = text[: text.index(label)]
    return python_blocks(text)


PAGES = sorted(
    p for p in DOCS.rglob("*.rst") if not {"_build", "_generated", "_static"} & set(p.relative_to(DOCS).parts)
)
RUN = [p for p in PAGES if page_blocks(p)]


def test_the_parser_finds_blocks_with_options_blank_lines_and_nesting() -> None:
    text = (
        "Intro\n\n.. code-block:: python\n   :caption: one\n\n   a = 1\n\n   b = a + 1\n\nText\n\n"
        "* item\n\n  .. code-block:: python\n\n     c = 3\n\n.. code-block:: console\n\n   $ ls\n"
    )
    assert python_blocks(text) == [(3, "a = 1\n\nb = a + 1"), (14, "c = 3")]


def test_every_page_with_code_is_collected() -> None:
    names = {p.relative_to(DOCS).as_posix() for p in RUN}
    assert {"index.rst", "backends.rst", "usage.rst", "tasks.rst", "real_models.rst", "tutorial.rst"} <= names
    assert sum(len(page_blocks(p)) for p in RUN) >= 15  # the pattern still matches the docs' blocks


@pytest.mark.parametrize("page", RUN, ids=[p.relative_to(DOCS).as_posix() for p in RUN])
def test_page_code_blocks_run_as_pasted(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    backends = importlib.import_module("kernelattn_core.engine.backends")  # the module (its name is also a function)
    monkeypatch.chdir(tmp_path)  # blocks that save files write here
    monkeypatch.setattr(backends, "_BACKENDS", dict(backends._BACKENDS))  # a block may register one
    # the sequence-parallel example runs under torchrun; here as its one-process group
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    torch.manual_seed(0)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    try:
        for line, code in page_blocks(page):
            exec(compile(code, f"{page.relative_to(DOCS)}:{line}", "exec"), namespace)  # the documented code
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def cli_commands(text: str) -> list[tuple[int, str]]:
    """``(line, command)`` of every ``kernelattn ...`` line inside an indented block of
    ``text`` (console blocks with or without ``$``, literal blocks), ``\\`` continuations
    joined."""
    lines = text.split("\n")
    found, i = [], 0
    while i < len(lines):
        m = re.match(r"^\s+(?:\$ )?(kernelattn\s.*)$", lines[i])
        if not m:
            i += 1
            continue
        start, command = i + 1, m.group(1)
        while command.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            command = command.rstrip()[:-1] + " " + lines[i].strip()
        found.append((start, command))
        i += 1
    return found


COMMANDS = [(p, line, c) for p in PAGES for line, c in cli_commands(p.read_text("utf-8"))]


def test_the_command_finder_joins_continuations() -> None:
    text = (
        "x\n\n   $ kernelattn convert m --budget 64 \\\n       --steps 4   # note\n"
        "   kernelattn plugins\nkernelattn prose\n"
    )
    expected = [(3, "kernelattn convert m --budget 64  --steps 4   # note"), (5, "kernelattn plugins")]
    assert cli_commands(text) == expected


@pytest.mark.parametrize(
    ("page", "line", "command"), COMMANDS, ids=[f"{p.relative_to(DOCS).as_posix()}:{line}" for p, line, _ in COMMANDS]
)
def test_documented_commands_parse(page: Path, line: int, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every ``kernelattn`` command the docs show is accepted by the command's parser (its
    options exist and their values parse); running them is the commands' own tests' job
    (some take minutes to hours)."""
    import shlex

    from kernelattn_core.cli.main import build_parser

    argv = shlex.split(command, comments=True)[1:]
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as exc:  # argparse's way of refusing
        pytest.fail(f"{page.name}:{line}: {command!r} does not parse: {capsys.readouterr().err.strip()} ({exc})")
    assert args.command == argv[0]


def test_the_docs_show_commands_of_every_kind() -> None:
    kinds = {c.split()[1] for _, _, c in COMMANDS}
    assert {"compare", "tasks", "convert", "verify", "plugins"} <= kinds, kinds


def test_a_command_with_an_unknown_option_does_not_parse() -> None:
    """The negative control of the check above: argparse refuses what the CLI lacks."""
    from kernelattn_core.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser(["tasks", "--no-such-option"]).parse_args(["tasks", "--no-such-option"])
