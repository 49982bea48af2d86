"""Reporting helpers at the base layer: what the library, the tools and the plugins use to
show results (issue 27: "the CLI as a leaf").

* ``output.py``: records as a table, CSV or JSON; the shared ``--format``/``--output``/``--plot``
  flags; a table printed row by row.
* ``plot.py``: figures (matplotlib, an optional extra, imported only when a figure is drawn).
* ``progress.py``: a progress bar on stderr, drawn only on a terminal.
* ``measure.py``: the time and peak tensor memory of a call, measured alike on every device.

They import nothing of the core above :mod:`kernelattn_core.errors`, so the engine's
experiments, :mod:`kernelattn_core.verify`, the tasks and the conversion import them
without reaching up into :mod:`kernelattn_core.cli`. This ``__init__`` imports none of them
(``measure`` imports torch; ``kernelattn --help`` must not). Plugins import these helpers
through :mod:`kernelattn_core.toolkit`. The ``kernelattn_core.cli.{output,plot,progress,measure}``
modules remain as re-exports of these.
"""
