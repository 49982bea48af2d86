"""Compatibility suite: frozen copies of third-party-style plugins written against earlier
plugin specs must keep passing ``kernelattn verify`` and the conformance kit unchanged.

* ``tutorial_v1_0``: the tutorial plugin as released with spec 1.0 (``git show
  d271824:docs/tutorial/kernelattn-example``), which declares ``PositiveFeatures`` (FM002)
  on a log-space map: deprecated since spec 1.1, so it warns and is checked in its
  meaningful form (finite log-features) instead of failing.
* ``everyclaim_v1_0``: a plugin declaring every claim family of spec 1.0 with 1.0's fields
  (AT002 with two budgets, FM002 on a log-space map, no ``KERNELATTN_SPEC``).

The frozen files are checked byte for byte (SHA-256) so that nobody "fixes" them: a
plugin that must change to keep passing is a broken spec, not a broken plugin.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

import kernelattn_core as ka
from kernelattn_core.claims.spec import ClaimDeprecationWarning
from kernelattn_core.errors import PluginError, PluginWarning
from kernelattn_core.hookspecs import SPEC_VERSION

HERE = Path(__file__).parent

#: SHA-256 of every frozen file, by plugin folder; the tutorial's equal
#: ``git show d271824:docs/tutorial/kernelattn-example/<file>``, the every-claim plugin's
#: are those it had when it was written (it passed spec 1.0's checks as written)
FROZEN = {
    "tutorial_v1_0": {
        "kernelattn_example/__init__.py": "8487c2d1041059ea65676be752ced1a5d0656477a39bedd047584cb31801517a",
        "kernelattn_example/feature_map.py": "45dc89fb48002f0211d970e2cac26354f82bdc4ab06cd01ca18f67cfaeb8bf90",
        "kernelattn_example/plugin.py": "9d77179be21484b45e699a37804ba859af30b339d347583ab4ac93917d5d443f",
        "released_tests/test_example_conformance.py": (
            "67243c4488162876f18f830aa4817c1c0b50fe98f507cacb3d000c084faefc77"
        ),
        "pyproject.toml": "2e936ca3507beec6e3bec4b999caac4d3a94280f466306e72b84d809eef39105",
    },
    "everyclaim_v1_0": {
        "kernelattn_everyclaim/__init__.py": "14c0248dd387fd5f29af0f19d0416d360dff24a9793bec0bf31f15394300339d",
        "kernelattn_everyclaim/classes.py": "aa29671bef078f444e04cf5a121680615d8dbbcb43054c7b9e6a70515521c237",
        "kernelattn_everyclaim/plugin.py": "a1cbdfae2bc5cbfc71997a8201d8436eb62671f4e7329910231f9b67389e2278",
    },
}

PLUGINS = {"example": "tutorial_v1_0/kernelattn_example", "everyclaim": "everyclaim_v1_0/kernelattn_everyclaim"}


def _load(folder: str, alias: str) -> types.ModuleType:
    """The frozen package under a private name (the installed tutorial owns ``kernelattn_example``);
    returns its ``plugin`` module, the one an entry point names."""
    if alias not in sys.modules:
        path = HERE / folder
        init = path / "__init__.py"
        spec = importlib.util.spec_from_file_location(alias, init, submodule_search_locations=[str(path)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[alias] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{alias}.plugin")


def _registry() -> ka.Registry:
    reg = ka.Registry(autoload=False)
    for name, folder in PLUGINS.items():
        reg.register_plugin(_load(folder, f"compat_{name}_v1_0"), name)
    return reg


@pytest.fixture(scope="module")
def frozen() -> Any:
    """The frozen plugins in a registry of their own (process-wide for the module), and
    their quick-level verify results (run once: about a minute)."""
    import kernelattn_core.registry as registry_module
    from kernelattn_core.verify import run_checks

    saved = registry_module._REGISTRY
    reg = _registry()
    registry_module._REGISTRY = reg
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = run_checks(list(PLUGINS), registry=reg)
        yield reg, results, [w for w in caught if issubclass(w.category, ClaimDeprecationWarning)]
    finally:
        registry_module._REGISTRY = saved


def test_frozen_files_are_unchanged() -> None:
    for folder, files in FROZEN.items():
        for name, digest in files.items():
            got = hashlib.sha256((HERE / folder / name).read_bytes()).hexdigest()
            assert got == digest, f"{folder}/{name} was edited: it is frozen"


def test_frozen_plugins_are_read_as_spec_1_0(frozen: Any) -> None:
    reg, _, _ = frozen
    assert {p.name: p.spec for p in reg.plugins()} == {"builtins": SPEC_VERSION, "example": "1.0", "everyclaim": "1.0"}
    assert all(not p.errors for p in reg.plugins())


def test_frozen_plugins_pass_verify_unchanged(frozen: Any) -> None:
    _, results, _ = frozen
    failed = [(r.rule, r.target, r.numbers) for r in results if not r.passed]
    assert not failed, failed
    rules = {r.rule for r in results}
    # every 1.0 claim family the plugins declare, plus the engine claims the core now implies
    assert {"FM001", "FM002", "FM003", "FM004", "FM005", "KN001", "KN002", "KN003", "SP001", "AT001", "AT002"} <= rules
    assert {"HP001", "EN001", "EN002", "EN003"} <= rules
    # AT002 with 1.0's two budgets runs as a rate over five
    at002 = [r for r in results if r.rule == "AT002"]
    assert all(r.numbers["budgets"] == [4, 8, 16, 32, 64] for r in at002)
    # a 1.0 class flagged unbiased is checked in train mode only, as 1.0 checked it (its eval
    # mode draws from a fixed seed; 1.1's default of both modes would fail a plugin 1.0 passed)
    at001 = [r for r in results if r.rule == "AT001"]
    assert len(at001) == 1 and "train mode" in at001[0].claim


def test_deprecated_fm002_warns_and_is_checked_in_its_meaningful_form(frozen: Any) -> None:
    _, results, caught = frozen
    fm002 = {r.target: r for r in results if r.rule == "FM002"}
    for target in ("example-antithetic", "everyclaim-prf"):  # log-space maps: deprecated form
        r = fm002[target]
        assert r.passed and "deprecated since plugin spec 1.1" in r.numbers["deprecated"]
        assert r.numbers["non_finite"] == 0 and r.numbers["log_features_checked"] > 0
        assert "log-feature" in r.claim
    assert "deprecated" not in fm002["everyclaim-softplus"].numbers  # a plain positive map: FM002 as stated
    assert {str(w.message).split("(")[1].split(")")[0] for w in caught} == {"example-antithetic", "everyclaim-prf"}


def test_the_meaningful_form_fails_a_log_space_map_with_infinite_log_features() -> None:
    """The deprecated claim is not vacuous in its checked form: a log-space map whose
    log-features overflow to inf (a feature of +inf) fails it."""
    from kernelattn_core import claims as C
    from kernelattn_core.registry import Entry
    from kernelattn_core.verify import check_claim

    plugin = _load(PLUGINS["example"], "compat_example_v1_0")
    cls = plugin.AntitheticPRF

    class Overflowing(cls):  # type: ignore[misc, valid-type]
        def _features(self, x, is_query):  # type: ignore[no-untyped-def]
            out = super()._features(x, is_query)
            return out.masked_fill(x.norm(dim=-1, keepdim=True) > 3.0, float("inf"))

    with pytest.warns(ClaimDeprecationWarning):
        result = check_claim(Entry("overflowing", "feature_map", Overflowing, "t"), C.PositiveFeatures())
    assert result.verdict == "fail" and result.numbers["non_finite"] > 0


def test_kit_on_frozen_plugins_is_verify_plus_structure(frozen: Any) -> None:
    """The kit runs the structural cases and one case per claim verify runs (engine claims
    included); the structural ones pass here, the claims passed in verify above."""
    from kernelattn_core.testing import conformance_cases
    from kernelattn_core.verify import claims_of, select

    reg, results, _ = frozen
    cases = conformance_cases(*PLUGINS, registry=reg)
    claim_cases = [c for c in cases if c.check.startswith("claim-")]
    expected = sum(len(claims_of(e)) for e in select(list(PLUGINS), reg))
    assert len(claim_cases) == expected == len(results)
    assert {c.check.split("-")[1] for c in claim_cases} >= {"EN001", "EN002", "EN003", "AT002", "FM002"}
    for case in cases:
        if not case.check.startswith("claim-"):
            case.run("quick")
    cheap = [c for c in claim_cases if c.check.split("-")[1] in ("EN001", "EN002", "EN003", "KN001")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ClaimDeprecationWarning)
        for case in cheap:
            case.run("quick")


def test_released_tutorial_test_file_runs_against_the_frozen_plugin(frozen: Any) -> None:
    """The released test file (one line: ``conformance_tests("example")``) builds its suite
    against the frozen plugin and every structural case of it passes."""
    source = (HERE / "tutorial_v1_0/released_tests/test_example_conformance.py").read_text()
    namespace: dict[str, Any] = {}
    exec(compile(source, "test_example_conformance.py", "exec"), namespace)
    test = namespace["test_conformance"]
    cases = test.pytestmark[0].args[1]
    assert {c.target for c in cases} == {"example-antithetic"} and len(cases) > 20


# --------------------------------------------------------------------------- the spec version
def _plugin_with_spec(spec: object) -> types.ModuleType:
    mod = types.ModuleType("specced")
    mod.KERNELATTN_SPEC = spec  # type: ignore[attr-defined]
    plugin = _load(PLUGINS["everyclaim"], "compat_everyclaim_v1_0")
    mod.kernelattn_kernels = plugin.kernelattn_kernels  # type: ignore[attr-defined]
    return mod


@pytest.mark.parametrize("spec", ["1.0", "1.1"])
def test_a_plugin_requiring_a_spec_this_core_provides_loads(spec: str) -> None:
    reg = ka.Registry(autoload=False, strict=True)
    info = reg.register_plugin(_plugin_with_spec(spec), "specced")
    assert info.spec == spec and [e.name for e in info.entries] == ["everyclaim-exp"]


@pytest.mark.parametrize("spec", ["1.9", "2.0", "0.9", "one", 1.1])
def test_a_plugin_requiring_another_spec_is_refused_naming_both_versions(spec: object) -> None:
    with pytest.raises(PluginError, match=f"KERNELATTN_SPEC.*provides spec {SPEC_VERSION}"):
        ka.Registry(autoload=False, strict=True).register_plugin(_plugin_with_spec(spec), "specced")
    with pytest.warns(PluginWarning, match="requires plugin spec"):
        info = ka.Registry(autoload=False).register_plugin(_plugin_with_spec(spec), "specced")
    assert not info.entries and info.errors
