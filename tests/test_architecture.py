"""Meta-tests of the core's structure (issue 27, "One spine"), measured by
``scripts/spine_metrics.py``: the goals that are met cannot regress.

* plugins (ours and the tutorial's) import only the top-level API and
  :mod:`kernelattn_core.toolkit`;
* the core has no static import circle (module- and function-level imports), and no more
  imports run back up the layers than today;
* every checker has a negative control on a synthetic source.

Static analysis only (ast, no torch import in the checks): about 1 s.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("spine_metrics", ROOT / "scripts" / "spine_metrics.py")
assert _spec is not None and _spec.loader is not None
M = importlib.util.module_from_spec(_spec)
sys.modules["spine_metrics"] = M
_spec.loader.exec_module(M)

#: imports running back up the layers (BEFORE: 14; 13 at the start of the layering steps, 4 once report/ left
#: cli/, 0 since): none may come back
MAX_UPWARD = 0


# ---------------------------------------------------------------------- plugin imports
def test_plugins_import_only_the_toolkit_and_the_top_level() -> None:
    files = M.plugin_files()
    assert len(files) > 50  # the six plugins and the tutorial, sources and tests
    found = M.plugin_import_lines(files)
    assert len(found) > 100
    bad = [f"{i['file']}:{i['line']} {i['module']} {i['names']}" for i in found if not i["published"]]
    assert bad == [], "plugins must import kernelattn_core or kernelattn_core.toolkit only:\n" + "\n".join(bad)


def test_the_plugin_import_checker_flags_internal_imports() -> None:
    """Negative control: each offending spelling is caught, the published ones are not."""
    source = "\n".join(
        [
            "import kernelattn_core as ka",
            "from kernelattn_core import FeatureMap, create",
            "from kernelattn_core.toolkit import InputError, construct",
            "from kernelattn_core.engine.naive import kernel_attention_naive",
            "from kernelattn_core.errors import InputError",
            "from kernelattn_core.toolkit import _EXPORTS",
            "import kernelattn_core.registry",
            "def f():",
            "    from kernelattn_core.lookup import resolve_class",  # inside a function too
        ]
    )
    found = M.classify_imports(source, "synthetic.py")
    assert [(i["line"], i["published"]) for i in found] == [
        (1, True),
        (2, True),
        (3, True),
        (4, False),
        (5, False),
        (6, False),
        (7, False),
        (9, False),
    ]
    assert [i["line"] for i in found if i["internal"]] == [4, 6, 7, 9]


def test_every_toolkit_name_resolves_and_is_public() -> None:
    import kernelattn_core.toolkit as tk

    assert tk.__all__ == sorted(tk._EXPORTS)
    assert not [n for n in tk.__all__ if n.startswith("_")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in tk.__all__:
            assert getattr(tk, name) is not None, name
    from kernelattn_core.builtins.estimators import _construct
    from kernelattn_core.testing.fuzz import _tensors

    assert tk.construct is _construct and tk.fuzz_tensors is _tensors
    with pytest.raises(AttributeError, match="not part of the published plugin toolkit"):
        tk.select_backend_privately


# ---------------------------------------------------------------------- import graph
def test_no_import_circle_in_the_core() -> None:
    circles = M.strongly_connected(M.import_graph(M.core_modules()))
    assert circles == []


def test_imports_running_back_up_do_not_grow() -> None:
    upward = M.upward_imports(M.import_graph(M.core_modules()))
    assert len(upward) <= MAX_UPWARD, "\n".join(f"{a} -> {b}" for a, b in upward)
    # the interfaces never reach up to the registry or the built-ins
    assert not [(a, b) for a, b in upward if a.startswith("kernelattn_core.interfaces") and "registry" in b]


def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    pkg = tmp_path / "kernelattn_core"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return M.core_modules(pkg)


def test_the_circle_checker_sees_function_level_imports(tmp_path: Path) -> None:
    """Negative control: a circle closed by an import inside a function is a circle;
    one closed only under ``TYPE_CHECKING`` is not."""
    modules = _package(
        tmp_path,
        {
            "__init__.py": "",
            "errors.py": "",
            "interfaces/__init__.py": "",
            "interfaces/feature_map.py": "def f():\n    from ..registry import get\n",
            "registry.py": "from .interfaces import feature_map\n",
            "engine/__init__.py": "",
            "engine/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n",
            "engine/b.py": "from . import a\n",
        },
    )
    graph = M.import_graph(modules)
    assert M.strongly_connected(graph) == [["kernelattn_core.interfaces.feature_map", "kernelattn_core.registry"]]
    assert M.upward_imports(graph) == [("kernelattn_core.interfaces.feature_map", "kernelattn_core.registry")]


def test_old_paths_are_aliases_that_nothing_in_the_core_imports() -> None:
    """Each old path of :data:`ALIASES` imports its new home and nothing else, and no core
    module imports it (the engine package resolves ``engine.kernel_attention`` through it,
    lazily); importing it gives the new module itself."""
    modules = M.core_modules()
    graph = M.import_graph(modules)
    for old, new in M.ALIASES.items():
        assert graph[f"kernelattn_core.{old}"] == {f"kernelattn_core.{new}"}, old
    aliases = {f"kernelattn_core.{old}" for old in M.ALIASES}
    importers = sorted((a, b) for a, targets in graph.items() for b in targets if b in aliases)
    assert importers == [("kernelattn_core.engine", "kernelattn_core.engine.api")]

    import kernelattn_core as ka

    assert importlib.import_module("kernelattn_core.engine.distributed") is importlib.import_module(
        "kernelattn_core.distributed"
    )
    assert importlib.import_module("kernelattn_core.claims.targets") is importlib.import_module(
        "kernelattn_core.verify.targets"
    )
    sys.modules.pop("kernelattn_core.engine.api", None)
    with pytest.warns(DeprecationWarning, match="import kernel_attention from kernelattn_core"):
        from kernelattn_core.engine import kernel_attention
    assert kernel_attention is ka.kernel_attention


def test_the_upward_checker_sees_literal_import_module_and_spares_declared_aliases(tmp_path: Path) -> None:
    """Negative control: ``import_module("kernelattn_core.x")`` is an import; an old path of
    :data:`ALIASES` pointing at its new home is not counted, the same import elsewhere is."""
    modules = _package(
        tmp_path,
        {
            "__init__.py": "",
            "api.py": "",
            "interfaces/__init__.py": "",
            "interfaces/feature_map.py": "import importlib\nimportlib.import_module('kernelattn_core.api')\n",
            "engine/__init__.py": "",
            "engine/api.py": "import sys, importlib as i\nsys.modules[__name__] = i.import_module(ALIAS)\n".replace(
                "ALIAS", "'kernelattn_core.api'"
            ),
            "engine/other.py": "from importlib import import_module\nimport_module('kernelattn_core.api')\n",
        },
    )
    graph = M.import_graph(modules)
    assert graph["kernelattn_core.engine.api"] == {"kernelattn_core.api"}
    assert M.upward_imports(graph) == [
        ("kernelattn_core.engine.other", "kernelattn_core.api"),
        ("kernelattn_core.interfaces.feature_map", "kernelattn_core.api"),
    ]


def test_backend_is_a_call_argument_the_estimator_is_not_changed() -> None:
    """``kernel_attention(..., backend=name)`` runs this call on ``name`` without setting the
    estimator's ``backend`` (before, during or after the call); the next plain call of the
    estimator is automatic again, and another estimator called inside is not forced."""
    import torch

    import kernelattn_core as ka

    B = importlib.import_module("kernelattn_core.engine.backends")
    est, other = ka.create("elu"), ka.create("elu")
    q, k, v = (
        torch.randn(1, 2, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    seen: list[object] = []

    def grouped(*args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
        seen.append(est.backend)
        if len(seen) == 1:
            other(q, k, v, causal=True)  # a nested call of another estimator: automatic
        return B._torch_grouped(*args, **kwargs)  # type: ignore[arg-type]

    probe = B.Backend("probe-call", -1, lambda: True, lambda p: True, B._load_torch, load_grouped=lambda: grouped)
    B.register_backend(probe)
    try:
        out = ka.kernel_attention(q, k, v, est, causal=True, backend="probe-call")
        assert seen == [None] and est.backend is None and est.last_backend == "probe-call"
        assert other.last_backend == "torch"
        torch.testing.assert_close(out, ka.kernel_attention(q, k, v, est, causal=True), rtol=1e-12, atol=1e-12)
        assert est.last_backend == "torch" and seen == [None]  # automatic again: the probe did not run
        with pytest.raises(ka.InputError, match="backend: expected 'auto' or one of"):
            ka.kernel_attention(q, k, v, est, backend="no-such-backend")
    finally:
        del B._BACKENDS["probe-call"]


def test_every_core_module_has_a_layer() -> None:
    modules = M.core_modules()
    assert {m: M.layer_of(m) for m in modules}  # raises KeyError naming a module in no layer
    assert M.layer_of("kernelattn_core.errors") < M.layer_of("kernelattn_core.interfaces.feature_map")
    assert M.layer_of("kernelattn_core.interfaces.names") < M.layer_of("kernelattn_core.registry")
    assert M.layer_of("kernelattn_core.registry") < M.layer_of("kernelattn_core.cli.main")
    with pytest.raises(KeyError):
        M.layer_of("elsewhere.module")


# ---------------------------------------------------------------------- backends and capabilities
def test_the_engine_calls_a_backend_records_grouped_entry_whatever_its_name() -> None:
    """No branch on a backend's name: a record with ``load_grouped`` is run through it, one
    without through ``load`` on materialised features; both agree with the torch backend."""
    import torch

    import kernelattn_core as ka

    # the module (``kernelattn_core.engine.backends`` as an attribute is the function backends())
    B = importlib.import_module("kernelattn_core.engine.backends")

    est = ka.create("prf", num_features=16, seed=0)
    q, k, v = (
        torch.randn(1, 2, 12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    ref = ka.kernel_attention(q, k, v, est, causal=True)  # builds the map
    calls: list[str] = []

    def grouped(*args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
        calls.append("grouped")
        return B._torch_grouped(*args, **kwargs)  # type: ignore[arg-type]

    def load() -> B.FeatureAttentionFn:
        calls.append("load")
        return B._load_torch()

    with_grouped = B.Backend("probe", -1, lambda: True, lambda p: True, load, load_grouped=lambda: grouped)
    plain = B.Backend("probe-plain", -1, lambda: True, lambda p: True, load)
    for backend, expected in ((with_grouped, ["grouped"]), (plain, ["load"])):
        calls.clear()
        out = B.attend_normalized(
            backend,
            est.feature_map,
            est.normalizer,
            q,
            k,
            v,
            causal=True,
            key_padding_mask=None,
            chunk_size=None,
            scale=est._input_root(q.shape[-1]),
        )
        assert calls == expected
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert B._BACKENDS["torch"].load_grouped is not None


def test_declared_capabilities_win_over_the_probes() -> None:
    from kernelattn_core.builtins import FeatureMapAttention, RowNormalizer
    from kernelattn_core.interfaces.estimator import AttentionEstimator, supports_step
    from kernelattn_core.interfaces.normalizer import takes_causal

    assert FeatureMapAttention.supports_step is True and supports_step(FeatureMapAttention("elu"))

    class Old(AttentionEstimator):  # spec 1.1: no declaration, a step method
        name = "old"

        def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
            return v

        def step(self) -> None: ...

    class Declared(Old):
        supports_step = False

    assert supports_step(Old()) and not supports_step(Declared())

    class OldNorm(RowNormalizer):
        def pre(self, q, k, *, key_padding_mask=None):  # type: ignore[no-untyped-def]
            return q, k

    class DeclaredNorm(OldNorm):
        causal_aware = True

    assert takes_causal(RowNormalizer()) and not takes_causal(OldNorm()) and takes_causal(DeclaredNorm())
