"""Registration mistakes of plugin authors (the plugin audit): each one is refused or
reported when the plugin registers, as a :class:`PluginWarning` naming the plugin, the
class and what is wrong; none crashes ``kernelattn plugins`` or ``kernelattn verify``,
and valid plugins are untouched. Plugins are registered in process (modules built here,
entry points faked), never installed."""

from __future__ import annotations

import types
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import kernelattn_core as ka
import kernelattn_core.registry as registry_module
from kernelattn_core import hookimpl
from kernelattn_core.claims import UnbiasedKernelEstimate
from kernelattn_core.errors import PluginError, PluginWarning, UnknownNameError
from kernelattn_core.interfaces import Kernel, KernelFamily

ROOT = Path(__file__).resolve().parents[1]


def _module(name: str, spec: Any = "1.1", **hooks: Any) -> types.ModuleType:
    """A plugin module stating ``KERNELATTN_SPEC = spec`` with ``hooks`` marked as hook
    implementations (a value wrapped in :func:`unmarked` is set as it is)."""
    mod = types.ModuleType(name)
    if spec is not None:
        mod.KERNELATTN_SPEC = spec  # type: ignore[attr-defined]
    for hook, value in hooks.items():
        setattr(mod, hook, value.function if isinstance(value, _Unmarked) else hookimpl(value))
    return mod


class _Unmarked:
    def __init__(self, function: Any) -> None:
        self.function = function


def unmarked(function: Any) -> _Unmarked:
    """A function a plugin module defines without ``@hookimpl``."""
    return _Unmarked(function)


def _map(name: str, **attrs: Any) -> type:
    """A valid deterministic feature map (elu + 1) named ``name``, with ``attrs`` changed."""
    return type("Map_" + name.replace("-", "_").replace("+", "plus"), (ka.EluFeatureMap,), {"name": name, **attrs})


class LinearKernel(Kernel):
    name: ClassVar[str] = "mistake-linear"

    def _evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-1, -2)


def _kernel(name: str, **attrs: Any) -> type:
    return type("Kernel_" + name.replace("-", "_"), (LinearKernel,), {"name": name, **attrs})


def _messages(record: Any) -> str:
    return " | ".join(str(w.message) for w in record)


def _register(reg: ka.Registry, plugin: types.ModuleType, name: str) -> tuple[ka.PluginInfo, str]:
    with pytest.warns(PluginWarning) as record:
        info = reg.register_plugin(plugin, name)
    return info, _messages(record)


# --------------------------------------------------------------------------- 2: kernel family
def test_kernel_family_given_as_a_valid_str_is_converted_and_the_listing_works(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    reg = ka.Registry(autoload=False, strict=True)
    cls = _kernel("str-family", family="general")
    reg.register_plugin(_module("kernfam", kernelattn_kernels=lambda: [cls]), "kernfam")
    assert reg.kernel("str-family").family is KernelFamily.GENERAL
    assert reg.get("str-family").flags()["family"] == "general"
    monkeypatch.setattr(registry_module, "_REGISTRY", reg)
    from kernelattn_core.toolkit import cli_main

    assert cli_main(["plugins"]) == 0
    assert "str-family" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["gaussian", 3, None])
def test_kernel_family_of_no_kind_is_refused_naming_the_class(family: Any) -> None:
    reg = ka.Registry(autoload=False)
    cls = _kernel("bad-family", family=family)
    info, text = _register(reg, _module("kernfam", kernelattn_kernels=lambda: [cls]), "kernfam")
    assert "'kernfam'" in text and "Kernel_bad_family" in text and "family must be a KernelFamily" in text
    assert "'dot-product'" in text and repr(family) in text
    assert "bad-family" not in reg.names() and info.errors


def test_entry_flags_never_crash_on_a_str_family() -> None:
    """A class put in a registry by hand (no registration check) still lists."""
    cls = type("Raw", (LinearKernel,), {"name": "raw", "family": "shift-invariant"})
    entry = registry_module.Entry("raw", "kernel", cls, "hand")
    assert entry.flags()["family"] == "shift-invariant"


# --------------------------------------------------------------------------- 3: malformed claims
@pytest.mark.parametrize(
    ("claims", "fragment"),
    [
        (("FM001",), "claims entry 0 is 'FM001', not a claim instance"),
        ((UnbiasedKernelEstimate,), "claim class UnbiasedKernelEstimate, not a claim instance"),
        ((UnbiasedKernelEstimate(), "FM004"), "claims entry 1 is 'FM004'"),
        ("FM001", "claims must be a tuple of claim instances, got str"),
        (UnbiasedKernelEstimate(), "claims must be a tuple of claim instances, got UnbiasedKernelEstimate"),
    ],
)
def test_malformed_claims_are_refused_at_registration(claims: Any, fragment: str) -> None:
    reg = ka.Registry(autoload=False)
    cls = _map("claim-mistake", kernel="softmax", claims=claims)
    _, text = _register(reg, _module("claimstr", kernelattn_feature_maps=lambda: [cls, _map("claim-ok")]), "claimstr")
    assert fragment in text and "Map_claim_mistake" in text and "'claimstr'" in text
    assert "claim-mistake" not in reg.names()
    assert reg.get("claim-ok").plugin == "claimstr"  # the plugin's other classes keep working
    with pytest.raises(PluginError, match="claim"):
        ka.Registry(autoload=False, strict=True).register_plugin(
            _module("claimstr", kernelattn_feature_maps=lambda: [cls]), "claimstr"
        )


def test_valid_claims_in_a_list_are_accepted() -> None:
    reg = ka.Registry(autoload=False, strict=True)
    cls = _map("claim-list", claims=[UnbiasedKernelEstimate(dims=(4,))])
    reg.register_plugin(_module("claimlist", kernelattn_feature_maps=lambda: [cls]), "claimlist")
    assert reg.feature_map("claim-list") is cls


# --------------------------------------------------------------------------- 5: duplicate names
def test_a_duplicate_name_skips_the_newcomer_and_names_it() -> None:
    reg = ka.Registry(autoload=False)
    orig = _map("orig-map", aliases=("orig-alias", "orig+"))
    reg.register_plugin(_module("orig", kernelattn_feature_maps=lambda: [orig]), "orig")
    hijack, hijack_alias = _map("orig-map"), _map("other-map", aliases=("orig+",))
    info, text = _register(reg, _module("dup", kernelattn_feature_maps=lambda: [hijack, hijack_alias]), "dup")
    assert "class Map_orig_map (plugin 'dup') is skipped" in text
    assert "class Map_other_map (plugin 'dup') is skipped" in text
    assert "the second one" not in text and "kernelattn plugin 'dup'" in text
    assert len(info.errors) == 2
    assert reg.plugin_of("orig-map").errors == []  # the error is the newcomer's, not the legitimate plugin's
    assert reg.get("orig-map").cls is orig and reg.get("orig+").cls is orig and reg.get("orig-alias").cls is orig
    assert "other-map" not in reg.names()


class _EntryPoint:
    """What :func:`importlib.metadata.entry_points` gives, for a module built here."""

    def __init__(self, name: str, dist: str, module: types.ModuleType) -> None:
        self.name, self.value, self.module = name, module.__name__, module
        self.dist = types.SimpleNamespace(name=dist, version="0.1")

    def load(self) -> types.ModuleType:
        return self.module


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, *eps: _EntryPoint) -> None:
    from importlib import metadata

    fake = types.SimpleNamespace(
        entry_points=lambda group: list(eps) if group == registry_module.ENTRY_POINT_GROUP else [],
        version=metadata.version,
        PackageNotFoundError=metadata.PackageNotFoundError,
    )
    monkeypatch.setattr(registry_module, "metadata", fake)


def test_a_shipped_plugin_keeps_its_names_whatever_the_entry_point_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit's ``dup`` plugin sorts before ``prf``: it used to take ``prf`` (and
    ``favor+``) from the shipped plugin, whose class was skipped with the error on it."""
    shipped = _map("prf", aliases=("favor+", "performer"))
    hijack, hijack_alias = _map("prf"), _map("reg-dup-alias", aliases=("favor+",))
    _fake_entry_points(
        monkeypatch,
        _EntryPoint("prf", "kernelattn-prf", _module("shipped_prf", kernelattn_feature_maps=lambda: [shipped])),
        _EntryPoint(
            "dup", "kernelattn-auditreg", _module("dup_plugin", kernelattn_feature_maps=lambda: [hijack, hijack_alias])
        ),
    )
    with pytest.warns(PluginWarning) as record:
        reg = ka.Registry(autoload=True)
    text = _messages(record)
    assert "kernelattn plugin 'dup'" in text and "kernelattn plugin 'prf'" not in text
    assert "class Map_prf (plugin 'dup') is skipped" in text and "plugin 'prf', registered before it" in text
    for name in ("prf", "favor+", "performer"):
        assert reg.get(name).cls is shipped
    assert reg.plugin_of("prf").errors == [] and len({p.name: p for p in reg.plugins()}["dup"].errors) == 2
    assert [p.name for p in reg.plugins()] == ["builtins", "prf", "dup"]


def test_load_order_puts_the_shipped_distributions_first() -> None:
    def ep(name: str, dist: str | None) -> Any:
        return types.SimpleNamespace(name=name, dist=None if dist is None else types.SimpleNamespace(name=dist))

    eps = [ep("aaa", "third-party"), ep("prf", "kernelattn_prf"), ep("dup", None), ep("fourier", "kernelattn-fourier")]
    assert [e.name for e in sorted(eps, key=registry_module._load_order)] == ["fourier", "prf", "aaa", "dup"]


# --------------------------------------------------------------------------- 6: aliases
@pytest.mark.parametrize(
    ("aliases", "fragment"),
    [
        ("zq", "aliases must be a tuple of names, got the str 'zq'"),
        (("Bad Alias!",), "aliases ['Bad Alias!'] are not registry names"),
        (("ok-alias", ""), "aliases [''] are not registry names"),
        ((3,), "aliases [3] are not registry names"),
        ({"a": 1}, "aliases must be a tuple of names, got dict"),
    ],
)
def test_bad_aliases_are_refused_naming_the_class(aliases: Any, fragment: str) -> None:
    reg = ka.Registry(autoload=False)
    cls = _map("aliased", aliases=aliases)
    info, text = _register(reg, _module("aliasstr", kernelattn_feature_maps=lambda: [cls]), "aliasstr")
    assert fragment in text and "Map_aliased" in text and "'aliasstr'" in text
    assert "aliased" not in reg.names() and info.errors
    for name in ("z", "q", "Bad Alias!", "ok-alias"):
        with pytest.raises(UnknownNameError):
            reg.get(name)


def test_valid_aliases_with_plus_are_accepted() -> None:
    reg = ka.Registry(autoload=False, strict=True)
    cls = _map("plus-map", aliases=["plus+", "plus-2"])
    reg.register_plugin(_module("plus", kernelattn_feature_maps=lambda: [cls]), "plus")
    assert reg.get("plus+").cls is cls and reg.get("plus-2").cls is cls


# --------------------------------------------------------------------------- 7: names referring to classes
@pytest.mark.parametrize(
    ("attrs", "fragment", "known"),
    [
        ({"kernel": "sofmax"}, "kernel = 'sofmax' is not the name of a registered kernel", "the kernels are: softmax"),
        ({"kernel": ka.SoftmaxKernel}, "(a class goes in target_kernel_class)", "the kernels are: softmax"),
        (
            {"default_normalizer": "rows"},
            "default_normalizer = 'rows' is not the name of a registered normalizer",
            "the normalizers are: row, signed-row",
        ),
    ],
)
def test_a_name_that_refers_to_no_class_is_reported_and_the_class_removed(
    attrs: dict[str, Any], fragment: str, known: str
) -> None:
    reg = ka.Registry(autoload=False)
    bad, good = _map("bad-ref", **attrs), _map("good-ref", kernel="softmax", default_normalizer="signed-row")
    info, text = _register(reg, _module("badref", kernelattn_feature_maps=lambda: [bad, good]), "badref")
    assert fragment in text and known in text and "Map_bad_ref ('bad-ref')" in text and "'badref'" in text
    assert "bad-ref" not in reg.names() and [e.name for e in info.entries] == ["good-ref"]
    with pytest.raises(PluginError, match="sofmax|rows|target_kernel_class"):
        ka.Registry(autoload=False, strict=True).register_plugin(
            _module("badref", kernelattn_feature_maps=lambda: [bad]), "badref"
        )


def test_a_target_kernel_class_that_is_no_kernel_is_refused() -> None:
    reg = ka.Registry(autoload=False)
    cls = _map("bad-target", target_kernel_class="softmax")
    _, text = _register(reg, _module("badtarget", kernelattn_feature_maps=lambda: [cls]), "badtarget")
    assert "target_kernel_class must be a Kernel subclass" in text and "bad-target" not in reg.names()


def test_names_may_refer_to_classes_of_plugins_loaded_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """References are checked once every entry point has registered: a map of plugin
    ``a-maps`` may target a kernel and use a normaliser of plugin ``z-extras``."""
    norm = type("ZNorm", (ka.RowNormalizer,), {"name": "z-norm"})
    cls = _map("a-map", kernel="z-kernel", default_normalizer="z-norm", unbiased=False)
    _fake_entry_points(
        monkeypatch,
        _EntryPoint("a-maps", "a-maps", _module("a_maps", kernelattn_feature_maps=lambda: [cls])),
        _EntryPoint(
            "z-extras",
            "z-extras",
            _module(
                "z_extras", kernelattn_kernels=lambda: [_kernel("z-kernel")], kernelattn_normalizers=lambda: [norm]
            ),
        ),
    )
    reg = ka.Registry(autoload=True, strict=True)
    assert reg.feature_map("a-map") is cls and reg.plugin_of("a-map").errors == []


# --------------------------------------------------------------------------- 8: hooks that are none
@pytest.mark.parametrize(
    ("hooks", "fragment"),
    [
        (
            {"kernelattn_feature_map": lambda: [_map("typo-map")]},
            "'kernelattn_feature_map' implements no kernelattn hook; did you mean 'kernelattn_feature_maps'",
        ),
        (
            {"kernelattn_feature_maps": unmarked(lambda: [_map("typo-map")])},
            "kernelattn_feature_maps is not marked with @kernelattn_core.hookimpl",
        ),
        ({"make_kernels": lambda: []}, "@hookimpl function 'make_kernels' implements no kernelattn hook"),
        (
            {"kernelattn_normaliser": unmarked(lambda: [])},
            "'kernelattn_normaliser' is not a kernelattn hook; did you mean 'kernelattn_normalizers'",
        ),
    ],
)
def test_a_plugin_whose_hooks_are_none_is_reported(hooks: dict[str, Any], fragment: str) -> None:
    reg = ka.Registry(autoload=False)
    info, text = _register(reg, _module("hooktypo", **hooks), "hooktypo")
    assert fragment in text and "'hooktypo'" in text and info.errors
    assert "typo-map" not in reg.names()


def test_helpers_of_a_plugin_are_not_taken_for_hooks() -> None:
    def make_maps() -> list[type]:
        return [_map("helper-map")]

    mod = _module(
        "helpers",
        kernelattn_feature_maps=lambda: make_maps(),
        kernelattn_feature_maps_v2=unmarked(lambda: make_maps()),  # a near miss of a hook the plugin implements
        build=unmarked(make_maps),
    )
    mod.kernelattn_core = ka  # type: ignore[attr-defined]  # a module, not a function
    reg = ka.Registry(autoload=False, strict=True)
    reg.register_plugin(mod, "helpers")
    assert "helper-map" in reg.names()


# --------------------------------------------------------------------------- 9: KERNELATTN_SPEC
@pytest.mark.parametrize("spec", [1.1, "1.1.0", "one", ""])
def test_a_malformed_spec_version_is_called_malformed(spec: Any) -> None:
    reg = ka.Registry(autoload=False)
    _, text = _register(
        reg, _module("badspec", spec=spec, kernelattn_feature_maps=lambda: [_map("spec-map")]), "badspec"
    )
    assert f"KERNELATTN_SPEC = {spec!r} (a {type(spec).__name__}) is malformed" in text
    assert "expected a string 'MAJOR.MINOR'" in text and "such as KERNELATTN_SPEC = '1.1'" in text
    assert f"requires plugin spec {spec!r}" not in text  # not "requires 1.1 ... provides 1.1"
    assert "spec-map" not in reg.names()


def test_a_newer_spec_version_still_names_both_versions() -> None:
    reg = ka.Registry(autoload=False)
    _, text = _register(
        reg, _module("newspec", spec="1.9", kernelattn_feature_maps=lambda: [_map("new-map")]), "newspec"
    )
    assert "requires plugin spec '1.9'" in text and "provides spec 1.1" in text


# --------------------------------------------------------------------------- 11: the shape an error names
@pytest.mark.parametrize("causal", [False, True])
def test_a_wrong_head_dimension_names_the_real_shape_of_q(use_registry: ka.Registry, causal: bool) -> None:
    q = torch.randn(2, 4, 5, 16)
    with pytest.raises(ka.InputError, match=r"q: expected last dimension d = 8, got shape \(2, 4, 5, 16\)"):
        ka.create("toy-prf", head_dim=8)(q, q, q, causal=causal)


# --------------------------------------------------------------------------- 12: the plugin author's kit
def test_the_tutorial_plugin_declares_its_test_extra() -> None:
    """spec/plugins.rst: the conformance kit builds pytest tests, so a plugin's ``[test]``
    extra depends on pytest; the tutorial's tests also run ``fuzz_tests`` (hypothesis)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "docs" / "tutorial" / "kernelattn-example" / "pyproject.toml").read_text())
    test = pyproject["project"]["optional-dependencies"]["test"]
    assert {r.split(">")[0].split("=")[0].strip() for r in test} >= {"pytest", "hypothesis"}


def test_the_toolkit_publishes_what_the_docs_point_plugin_authors_to() -> None:
    import kernelattn_core.toolkit as tk
    from kernelattn_core.claims.spec import ClaimDeprecationWarning
    from kernelattn_core.testing import conformance_cases

    assert {"conformance_cases", "ClaimDeprecationWarning"} <= set(tk.__all__)
    assert tk.conformance_cases is conformance_cases and tk.ClaimDeprecationWarning is ClaimDeprecationWarning


# --------------------------------------------------------------------------- valid plugins are untouched
def test_the_shipped_plugins_and_the_toys_register_without_a_word() -> None:
    """The new registration checks refuse nothing the plugins of this repository, the
    tutorial's and the test toys declare (strict: any report would raise)."""
    from importlib import metadata

    from . import toy_plugin

    ours = registry_module.SHIPPED_DISTRIBUTIONS | {"kernelattn-example"}
    others = [
        ep.name
        for ep in metadata.entry_points(group=registry_module.ENTRY_POINT_GROUP)
        if ep.dist is None or ep.dist.name not in ours
    ]
    reg = ka.Registry(autoload=True, strict=True, block=others)
    reg.register_plugin(toy_plugin, "toys")
    assert "toy-prf" in reg.names() and all(not p.errors for p in reg.plugins())


def test_registration_works_with_pluggys_before_1_7(monkeypatch: pytest.MonkeyPatch) -> None:
    """pluggy 1.3-1.6 (the declared minimum is 1.3) read ``getattr(plugin, name)`` with no
    default in ``parse_hookimpl_opts``: asking it about a hook the plugin does not
    implement raised AttributeError, and building the registry failed for every user of
    those versions (seen on the GPU machine's pluggy 1.6). That lookup is emulated here."""
    import pluggy

    def strict(self: pluggy.PluginManager, plugin: object, name: str) -> Any:
        method = getattr(plugin, name)  # no default, as before 1.7
        if not callable(method):
            return None
        return getattr(method, self.project_name + "_impl", None)

    monkeypatch.setattr(pluggy.PluginManager, "parse_hookimpl_opts", strict)
    reg = ka.Registry(autoload=False)
    assert "elu" in reg.names()
    # a plugin implementing one hook only registers its names, with no warning
    mod = _module("pluggy_compat", kernelattn_feature_maps=lambda: [_map("pluggy-compat-map")])
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        info = reg.register_plugin(mod, "pluggy-compat")
    assert "pluggy-compat-map" in reg.names() and not info.errors
