"""Sphinx configuration of the kernelattn docs."""

from __future__ import annotations

project = "kernelattn"
author = "kernelattn developers"
copyright = "2026, kernelattn developers"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
napoleon_numpy_docstring = True
napoleon_google_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
exclude_patterns = ["_build", "tutorial/kernelattn-example/*.md", "tutorial/kernelattn-example/**/*.md"]
nitpicky = False
html_theme = "alabaster"
