"""Every plugin shipped under plugins/ has an API section in its docs page, and that
section (docs/conf.py's ``kernelattn-plugin-api`` directive) documents every class the
plugin registers. The hybrid plugin's page had none while ``sphinx -W`` passed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from kernelattn_core import get_registry

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.name.removeprefix("kernelattn-") for p in (ROOT / "plugins").glob("kernelattn-*") if p.is_dir())


def _conf():
    spec = importlib.util.spec_from_file_location("_kernelattn_docs_conf", ROOT / "docs" / "conf.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _directives() -> dict[str, Path]:
    found = {}
    for page in (ROOT / "docs").rglob("*.rst"):
        for name in re.findall(r"^\.\. kernelattn-plugin-api:: (\S+)", page.read_text(encoding="utf-8"), flags=re.M):
            found[name] = page
    return found


def test_every_shipped_plugin_is_installed_and_found():
    installed = {p.name for p in get_registry().plugins()}
    assert SHIPPED and set(SHIPPED) <= installed, (SHIPPED, installed)


@pytest.mark.parametrize("plugin", SHIPPED)
def test_plugin_page_has_its_api(plugin):
    pages = _directives()
    assert plugin in pages, f"no docs page has '.. kernelattn-plugin-api:: {plugin}'"
    assert pages[plugin] == ROOT / "docs" / "plugins" / f"{plugin}.rst"


@pytest.mark.parametrize("plugin", SHIPPED)
def test_api_section_documents_every_registered_class(plugin):
    lines = "\n".join(_conf()._plugin_api_lines(plugin, None))
    info = next(p for p in get_registry().plugins() if p.name == plugin)
    assert info.entries
    for e in info.entries:
        path = f"{e.cls.__module__}.{e.cls.__qualname__}"
        assert f".. autoclass:: {path}\n" in lines, f"{plugin}: {e.name} ({path}) is not documented"
        assert f"``{e.name}``" in lines
