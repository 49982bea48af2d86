"""The plugin registry: discovery, isolation of broken plugins, switches."""

from __future__ import annotations

import sys
import textwrap
import types
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core import hookimpl, hookspecs
from kernelattn_core.errors import PluginError, PluginWarning, UnknownNameError

from . import toy_plugin


def _module(name: str, **hooks) -> types.ModuleType:  # type: ignore[no-untyped-def]
    mod = types.ModuleType(name)
    for hook, value in hooks.items():
        setattr(mod, hook, hookimpl(value))
    return mod


class Elu2(ka.EluFeatureMap):
    name: ClassVar[str] = "elu"  # clashes with the built-in


class Unnamed(ka.EluFeatureMap):
    name: ClassVar[str] = "Bad Name"


class Abstract(ka.FeatureMap):
    name: ClassVar[str] = "abstract-map"


class BadFlag(ka.EluFeatureMap):
    name: ClassVar[str] = "bad-flag"
    positive = "yes"  # type: ignore[assignment]


def test_builtins_are_registered_first() -> None:
    reg = ka.Registry(autoload=False)
    assert reg.plugins()[0].name == "builtins"
    assert {"softmax", "elu", "row", "exact", "feature-map"} <= set(reg.names())
    assert reg.kernel("softmax") is ka.SoftmaxKernel
    assert reg.get("linear-elu").cls is ka.EluFeatureMap  # alias


def test_duplicate_name_is_an_error_naming_both_classes_and_plugins() -> None:
    reg = ka.Registry(autoload=False, strict=True)
    with pytest.raises(PluginError) as err:
        reg.register_plugin(_module("dup", kernelattn_feature_maps=lambda: [Elu2]), "dup")
    text = str(err.value)
    assert "'elu'" in text and "Elu2" in text and "EluFeatureMap" in text
    assert "'dup'" in text and "'builtins'" in text


@pytest.mark.parametrize(
    ("cls", "fragment"),
    [
        (Unnamed, "registry name"),
        (Abstract, "abstract methods"),
        (BadFlag, "capability flag 'positive'"),
        (ka.SoftmaxKernel, "not a subclass of FeatureMap"),
        (42, "not a subclass of FeatureMap"),
    ],
)
def test_bad_class_is_an_error_naming_class_and_plugin(cls, fragment: str) -> None:  # type: ignore[no-untyped-def]
    reg = ka.Registry(autoload=False, strict=True)
    with pytest.raises(PluginError, match=fragment) as err:
        reg.register_plugin(_module("badplug", kernelattn_feature_maps=lambda: [cls]), "badplug")
    assert "'badplug'" in str(err.value)


def test_broken_plugin_is_isolated_as_a_warning() -> None:
    reg = ka.Registry(autoload=False)

    def boom():  # type: ignore[no-untyped-def]
        raise RuntimeError("kaboom")

    broken = _module("broken", kernelattn_kernels=boom, kernelattn_feature_maps=lambda: [Abstract, Elu2])
    with pytest.warns(PluginWarning) as record:
        info = reg.register_plugin(broken, "broken")
    messages = " | ".join(str(w.message) for w in record)
    assert "kaboom" in messages and "'broken'" in messages and "Abstract" in messages and "Elu2" in messages
    assert len(info.errors) == 3
    reg.register_plugin(toy_plugin, "toys")  # other plugins keep working
    assert reg.feature_map("toy-prf") is toy_plugin.ToyPRF
    assert reg.feature_map("elu") is ka.EluFeatureMap


def test_hook_returning_a_non_list_is_reported() -> None:
    reg = ka.Registry(autoload=False)
    with pytest.warns(PluginWarning, match="must return a list"):
        reg.register_plugin(_module("odd", kernelattn_kernels=lambda: ka.SoftmaxKernel), "odd")


def test_unknown_name_lists_the_available_names() -> None:
    reg = ka.Registry(autoload=False)
    with pytest.raises(UnknownNameError, match="unknown class name 'nope'; available: .*elu.*softmax"):
        reg.get("nope")
    with pytest.raises(UnknownNameError, match="unknown kernel name 'elu'; available: softmax"):
        reg.kernel("elu")


def test_create_unknown_estimator_lists_available(use_registry) -> None:
    with pytest.raises(UnknownNameError, match="'perfromer'.*available:.*toy-prf"):
        ka.create("perfromer")


def test_create_rejects_unknown_options_naming_them(use_registry) -> None:
    with pytest.raises(ka.InputError, match=r"unknown option\(s\) \['num_feature'\].*accepted options"):
        ka.create("toy-prf", num_feature=3)


def test_hookimpl_is_reexported_and_every_hook_is_prefixed() -> None:
    assert ka.hookimpl is hookspecs.hookimpl
    hooks = [n for n in dir(hookspecs) if n.startswith("kernelattn_")]
    assert set(hooks) == {
        "kernelattn_kernels",
        "kernelattn_feature_maps",
        "kernelattn_normalizers",
        "kernelattn_estimators",
        "kernelattn_experiments",
    }


# --------------------------------------------------------------------------- real entry points
@pytest.fixture
def installed_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Three distributions installed on sys.path with real ``kernelattn`` entry points:
    a working one, one that fails to import, and one whose hook raises."""
    (tmp_path / "ka_good_plugin.py").write_text(
        textwrap.dedent(
            '''
            from typing import ClassVar
            import kernelattn_core as ka

            class Doubled(ka.EluFeatureMap):
                """elu(x)+1, twice (a different estimate with the same normalised output)."""
                name: ClassVar[str] = "doubled-elu"

                def _features(self, x, is_query):
                    return 2 * super()._features(x, is_query)

            @ka.hookimpl
            def kernelattn_feature_maps():
                return [Doubled]
            '''
        )
    )
    (tmp_path / "ka_raising_plugin.py").write_text(
        "import kernelattn_core as ka\n\n@ka.hookimpl\ndef kernelattn_kernels():\n    raise ValueError('bad hook')\n"
    )
    for dist, ep_name, target in (
        ("ka-good-plugin", "good", "ka_good_plugin"),
        ("ka-broken-plugin", "broken", "ka_missing_module_xyz"),
        ("ka-raising-plugin", "raising", "ka_raising_plugin"),
    ):
        info = tmp_path / f"{dist.replace('-', '_')}-1.2.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
        (info / "entry_points.txt").write_text(f"[kernelattn]\n{ep_name} = {target}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("ka_good_plugin", None)
    sys.modules.pop("ka_raising_plugin", None)


def test_plugin_installed_through_a_real_entry_point(installed_plugins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kernelattn_core.registry as registry_module

    with pytest.warns(PluginWarning) as record:
        reg = ka.Registry(autoload=True)
    monkeypatch.setattr(registry_module, "_REGISTRY", reg)
    messages = " | ".join(str(w.message) for w in record)
    assert "'broken'" in messages and "ModuleNotFoundError" in messages
    assert "'raising'" in messages and "bad hook" in messages
    entry = reg.get("doubled-elu")
    info = reg.plugin_of("doubled-elu")
    assert (entry.plugin, info.distribution, info.version) == ("good", "ka-good-plugin", "1.2.3")
    # the plugin's class works end to end through the engine
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    out = ka.create("doubled-elu")(q, q, q)
    torch.testing.assert_close(out, ka.create("elu")(q, q, q))


def test_autoload_switch_skips_entry_points(installed_plugins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELATTN_DISABLE_PLUGIN_AUTOLOAD", "1")
    reg = ka.Registry()
    assert [p.name for p in reg.plugins()] == ["builtins"]


def test_block_list_skips_named_plugins(installed_plugins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELATTN_BLOCK_PLUGINS", "broken, raising")
    reg = ka.Registry(block=["unrelated"])
    names = [p.name for p in reg.plugins()]
    assert "good" in names and "broken" not in names and "raising" not in names


def test_strict_mode_raises_on_a_broken_entry_point(installed_plugins: Path) -> None:
    with pytest.raises(PluginError, match="'broken'.*failed to import"):
        ka.Registry(autoload=True, strict=True)


def test_trace_switch_prints_every_hook_call(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KERNELATTN_TRACE_HOOKS", "1")
    ka.Registry(autoload=False)
    err = capsys.readouterr().err
    assert "calling kernelattn_kernels of plugin 'builtins'" in err
    assert "kernelattn_estimators of plugin 'builtins' returned ['exact', 'feature-map']" in err
    monkeypatch.delenv("KERNELATTN_TRACE_HOOKS")
    ka.Registry(autoload=False)
    assert capsys.readouterr().err == ""


def _install(tmp_path: Path, dist: str, ep_name: str, module: str, source: str) -> None:
    (tmp_path / f"{module}.py").write_text(source)
    info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kernelattn]\n{ep_name} = {module}\n")


def test_plugin_raising_system_exit_at_import_is_isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(tmp_path, "ka-exiting-plugin", "exiting", "ka_exiting_plugin", "raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(PluginWarning, match=r"'exiting'.*SystemExit"):
        reg = ka.Registry(autoload=True)
    assert reg.get("softmax").plugin == "builtins"
    assert any(p.name == "exiting" and p.errors for p in reg.plugins())
    with pytest.raises(PluginError, match=r"'exiting'.*SystemExit"):
        ka.Registry(autoload=True, strict=True)


def test_plugin_hook_raising_system_exit_is_isolated() -> None:
    class Exiting:
        @ka.hookimpl
        def kernelattn_kernels(self):  # type: ignore[no-untyped-def]
            raise SystemExit("no")

    reg = ka.Registry(autoload=False)
    with pytest.warns(PluginWarning, match=r"'exiting'.*SystemExit"):
        reg.register_plugin(Exiting(), "exiting")
    assert "softmax" in reg.names("kernel")


def test_keyboard_interrupt_at_plugin_import_still_propagates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(tmp_path, "ka-interrupting-plugin", "interrupting", "ka_interrupting_plugin", "raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        ka.Registry(autoload=True)


@pytest.mark.parametrize("name", ["softmax", "exact"])
def test_option_to_an_option_less_class_names_the_option_and_the_class(name: str) -> None:
    options = {"foo": 1} if name == "softmax" else {"kernel": "softmax", "foo": 1}
    with pytest.raises(ka.InputError, match=r"'softmax' takes no options, got option\(s\) \['foo'\]"):
        ka.create(name, **options)


def test_importing_the_interfaces_does_not_import_the_registry() -> None:
    """The registry imports the interfaces; the interfaces must not import it back. The
    package ``__init__`` (which imports everything) is bypassed so that only what
    ``kernelattn_core.interfaces`` itself pulls in gets imported."""
    import subprocess

    code = textwrap.dedent(
        """
        import sys, types, pathlib, importlib.util
        spec = importlib.util.find_spec("kernelattn_core")
        pkg = types.ModuleType("kernelattn_core")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["kernelattn_core"] = pkg
        import kernelattn_core.interfaces, kernelattn_core.builtins.estimators, kernelattn_core.redraw
        print(sorted(m for m in sys.modules if m.startswith("kernelattn_core")))
        assert "kernelattn_core.registry" not in sys.modules
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout


def test_no_core_module_below_the_registry_imports_it_lazily() -> None:
    """A function-level ``from ..registry import`` would hide the circle from the test above."""
    import ast

    root = Path(ka.__file__).parent
    # module.py sits above the registry (it builds estimators with create()), so it is not listed
    files = [*(root / "interfaces").glob("*.py"), *(root / "builtins").glob("*.py")]
    # lookup.py is only the deprecated shim of the registry's resolve (it sits above it);
    # names given below the registry meet it through interfaces/names.py, which never imports it
    files += [root / "redraw.py", root / "validation.py"]
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "registry":
                offenders.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Import) and any(a.name.endswith(".registry") for a in node.names):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


def test_target_kernel_resolves_through_the_installed_registry() -> None:
    rff = ka.get_registry().feature_map("rff")(num_features=4)
    assert type(rff.target_kernel()).__name__ == "GaussianKernel"


def test_create_resolves_every_name_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27: names are resolved in create() (and the registry) only; what it builds
    receives classes. With the lookup below the registry disabled, create still builds
    and runs; a constructor given a name directly needs it (the negative control)."""
    import torch

    from kernelattn_core.builtins import ExactAttention, FeatureMapAttention
    from kernelattn_core.errors import KernelAttnError
    from kernelattn_core.interfaces import names

    ka.get_registry()
    monkeypatch.setattr(names, "_resolver", None)
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    for name, options in (("softmax", {}), ("elu", {}), ("elu", {"normalizer": "signed-row"}), ("rff", {})):
        est = ka.create(name, **options)
        assert torch.isfinite(ka.kernel_attention(q, q, q, est)).all()
    assert type(ka.create("elu", normalizer="signed-row").normalizer).__name__ == "SignedRowNormalizer"
    with pytest.raises(KernelAttnError, match="no registry is loaded"):
        ExactAttention("gaussian")
    with pytest.raises(KernelAttnError, match="no registry is loaded"):
        FeatureMapAttention("elu", normalizer="row")


def test_constructors_given_names_still_resolve_through_the_registry() -> None:
    from kernelattn_core.builtins import ExactAttention, FeatureMapAttention

    assert type(ExactAttention("gaussian").kernel).__name__ == "GaussianKernel"
    est = FeatureMapAttention("rff", normalizer="signed-row", num_features=8)
    assert type(est.feature_map).__name__ == "RandomFourierFeatures"
    assert type(est.normalizer).__name__ == "SignedRowNormalizer"
    with pytest.raises(ka.UnknownNameError, match="unknown kernel name 'nope'"):
        ExactAttention("nope")


def test_declared_target_kernel_class_needs_no_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelattn_core.builtins import EluFeatureMap, SoftmaxKernel
    from kernelattn_core.interfaces import names

    class Declared(EluFeatureMap):
        kernel = "softmax"
        target_kernel_class = SoftmaxKernel

    class ByName(EluFeatureMap):
        kernel = "softmax"

    monkeypatch.setattr(names, "_resolver", None)
    assert isinstance(Declared().target_kernel(), SoftmaxKernel)
    with pytest.raises(ka.KernelAttnError, match="no registry is loaded"):
        ByName().target_kernel()


def test_lookup_is_a_deprecated_shim_of_the_registry() -> None:
    import kernelattn_core.lookup as lookup
    from kernelattn_core import registry

    with pytest.warns(DeprecationWarning, match="kernelattn_core.registry.resolve_class"):
        fn = lookup.resolve_class
    assert fn is registry.resolve_class
    assert fn("gaussian", "kernel").__name__ == "GaussianKernel"
    with pytest.raises(AttributeError):
        lookup.nothing_here
