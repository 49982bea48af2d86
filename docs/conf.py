"""Sphinx configuration of the kernelattn docs.

Math renders offline: ``sphinx-mathjax-offline`` (the ``docs`` extra) copies MathJax 3
into ``_static/mathjax`` and points ``mathjax_path`` there, so no page loads a CDN.

``.. kernelattn-plugin-api:: NAME`` (defined below) writes the API of one plugin from the
registry: a table of its registered names, kinds and aliases, then autodoc of every class
it registers and of every other public object of its package (``__all__``), so a new
plugin's page needs one line and lists every class.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

project = "kernelattn"
author = "kernelattn developers"
copyright = "2026, kernelattn developers"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",
    "sphinx.ext.viewcode",
]
napoleon_numpy_docstring = True
napoleon_google_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # docstring "Attributes" as fields: no duplicate of a documented property
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
exclude_patterns = ["_build", "tutorial/kernelattn-example/*.md", "tutorial/kernelattn-example/**/*.md"]
nitpicky = False
html_theme = "alabaster"
# figures of ``nox -s bench`` land in docs/_static/bench (see benchmarks.rst)
html_static_path = ["_static"] if (Path(__file__).parent / "_static").is_dir() else []


def _plugin_api_lines(plugin: str, package: str | None) -> list[str]:
    """reStructuredText of one plugin's API (see the module docstring)."""
    from kernelattn_core import get_registry

    info = next((p for p in get_registry().plugins() if p.name == plugin), None)
    if info is None:
        raise ValueError(f"kernelattn-plugin-api: no installed plugin {plugin!r}")
    entries = list(info.entries)
    if package is None:
        roots = {e.cls.__module__.split(".")[0] for e in entries}
        package = roots.pop() if len(roots) == 1 else f"kernelattn_{plugin}"
    module = importlib.import_module(package)
    lines = ["Registered names", "~~~~~~~~~~~~~~~~", ""]
    if entries:
        lines += [".. list-table::", "   :header-rows: 1", ""]
        lines += ["   * - name", "     - kind", "     - aliases", "     - class"]
        for e in entries:
            aliases = ", ".join(f"``{a}``" for a in vars(e.cls).get("aliases", ())) or "–"
            lines += [
                f"   * - ``{e.name}``",
                f"     - {e.kind.replace('_', ' ')}",
                f"     - {aliases}",
                f"     - :class:`~{e.cls.__module__}.{e.cls.__qualname__}`",
            ]
        lines.append("")
    objects: list[Any] = [e.cls for e in entries]
    for name in getattr(module, "__all__", ()):
        obj = getattr(module, name)
        own = getattr(obj, "__module__", "").split(".")[0] == package.split(".")[0]  # not re-exports
        if own and (isinstance(obj, type) or callable(obj)) and not any(obj is o for o in objects):
            objects.append(obj)
    lines += ["Classes and functions", "~~~~~~~~~~~~~~~~~~~~~", ""]
    for obj in objects:
        path = f"{obj.__module__}.{obj.__qualname__}"
        if isinstance(obj, type):
            lines += [f".. autoclass:: {path}", "   :members:", "   :show-inheritance:", ""]
        else:
            lines += [f".. autofunction:: {path}", ""]
    return lines


def setup(app: Any) -> dict[str, Any]:
    from docutils.parsers.rst import directives
    from docutils.statemachine import StringList
    from sphinx.util.docutils import SphinxDirective
    from sphinx.util.nodes import nested_parse_with_titles

    class PluginAPI(SphinxDirective):
        """``.. kernelattn-plugin-api:: NAME`` with an optional ``:package:`` (import name)."""

        required_arguments = 1
        option_spec = {"package": directives.unchanged}  # noqa: RUF012

        def run(self) -> list[Any]:
            from docutils import nodes

            lines = _plugin_api_lines(self.arguments[0], self.options.get("package"))
            node = nodes.section()
            node.document = self.state.document
            nested_parse_with_titles(self.state, StringList(lines, source=f"<plugin-api {self.arguments[0]}>"), node)
            return node.children

    app.add_directive("kernelattn-plugin-api", PluginAPI)
    return {"parallel_read_safe": True}
