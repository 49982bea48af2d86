"""The docs load nothing from the network, and the plugin API directive covers every registered class."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _load(name: str, path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_offline_check_finds_remote_scripts_and_passes_local_ones(tmp_path) -> None:  # type: ignore[no-untyped-def]
    check = _load("check_offline", DOCS / "check_offline.py")
    (tmp_path / "sub").mkdir()
    (tmp_path / "ok.html").write_text('<script src="_static/mathjax/tex-chtml.js"></script>')
    assert check.remote_assets(tmp_path) == [] and check.main([str(tmp_path)]) == 0
    cdn = "https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"
    (tmp_path / "sub" / "bad.html").write_text(f'<p>x</p><script defer="defer" src="{cdn}"></script>')
    (tmp_path / "css.html").write_text('<link rel="stylesheet" href="//fonts.example.org/a.css" />')
    assert check.remote_assets(tmp_path) == [("css.html", "//fonts.example.org/a.css"), ("sub/bad.html", cdn)]
    assert check.main([str(tmp_path)]) == 1


def test_docs_bundle_mathjax() -> None:
    pytest.importorskip("sphinx")
    conf = _load("docs_conf", DOCS / "conf.py")
    assert "sphinx-mathjax-offline" in conf.extensions
    ext = importlib.util.find_spec("sphinx-mathjax-offline")
    if ext is None:
        pytest.skip("the docs extra is not installed")
    assert (Path(ext.origin).parent / "static" / "mathjax" / "tex-chtml.js").is_file()


def test_plugin_api_lists_every_registered_class_and_alias() -> None:
    pytest.importorskip("kernelattn_maclaurin")
    conf = _load("docs_conf", DOCS / "conf.py")
    text = "\n".join(conf._plugin_api_lines("maclaurin", None))
    from kernelattn_core import get_registry

    entries = [e for e in get_registry().entries() if e.plugin == "maclaurin"]
    assert entries
    for e in entries:
        assert f".. autoclass:: {e.cls.__module__}.{e.cls.__qualname__}" in text
        assert f"``{e.name}``" in text
    assert "``macformer``" in text
    assert ".. autofunction:: kernelattn_maclaurin.variance.rmf_variance" in text  # public functions too
    with pytest.raises(ValueError, match="no installed plugin 'nope'"):
        conf._plugin_api_lines("nope", None)
