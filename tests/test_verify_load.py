"""A plugin that fails to load, or a name that matches nothing, fails ``kernelattn verify``
and the conformance kit, naming the load error; never "0 passed"."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from importlib import metadata
from pathlib import Path

import pytest

import kernelattn_core as ka
import kernelattn_core.registry as registry_module
from kernelattn_core.cli.main import main
from kernelattn_core.errors import PluginError, UnknownNameError
from kernelattn_core.testing.conformance import conformance_cases
from kernelattn_core.verify import load_errors, select


class _BrokenEntryPoint:
    name = "broken"
    value = "kernelattn_broken_plugin.plugin"
    group = "kernelattn"
    dist = None

    def load(self) -> object:
        raise ImportError("No module named 'kernelattn_broken_plugin'")


@pytest.fixture
def broken_registry(monkeypatch: pytest.MonkeyPatch) -> ka.Registry:
    monkeypatch.setattr(metadata, "entry_points", lambda group=None: [_BrokenEntryPoint()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        registry = ka.Registry(autoload=True)
    monkeypatch.setattr(registry_module, "_REGISTRY", registry)
    return registry


def test_load_error_is_recorded_and_select_raises_naming_it(broken_registry: ka.Registry) -> None:
    assert load_errors(broken_registry) == [
        "broken: failed to import 'kernelattn_broken_plugin.plugin': ImportError: No module named "
        "'kernelattn_broken_plugin'"
    ]
    with pytest.raises(PluginError, match="broken: failed to import.*kernelattn_broken_plugin"):
        select(["broken"], broken_registry)
    with pytest.raises(PluginError, match="broken"):
        select([], broken_registry)  # verify with no names checks everything: a broken plugin fails it
    assert select(["softmax"], broken_registry)  # a class of a healthy plugin is still checkable on its own


def test_verify_cli_exits_nonzero_and_names_the_load_error(
    broken_registry: ka.Registry, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "broken", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "failed to import" in err and "kernelattn_broken_plugin" in err
    assert main(["verify", "nothing-by-this-name", "--no-progress"]) == 2


def test_conformance_kit_refuses_a_broken_or_empty_selection(broken_registry: ka.Registry) -> None:
    with pytest.raises(PluginError, match="failed to import"):
        conformance_cases("broken", registry=broken_registry)
    with pytest.raises(UnknownNameError):
        conformance_cases("nothing-by-this-name", registry=broken_registry)


def test_a_plugin_that_registers_nothing_is_an_error() -> None:
    registry = ka.Registry(autoload=False)
    registry.register_plugin(object(), "empty")
    with pytest.raises(UnknownNameError, match="registered no class"):
        select(["empty"], registry)


def test_conformance_tests_of_a_missing_plugin_fail_the_pytest_run(tmp_path: Path) -> None:
    """End to end: the one-file kit of a plugin that is not installed exits non-zero under pytest."""
    test_file = tmp_path / "test_kit.py"
    test_file.write_text(
        textwrap.dedent(
            """
            from kernelattn_core.testing import conformance_tests

            test_conformance = conformance_tests("no-such-plugin")
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode != 0, proc.stdout
    assert "no-such-plugin" in proc.stdout


def test_unbiasedness_is_checked_per_mode() -> None:
    """``ra`` is unbiased in training; evaluation drops the noise (biased) unless
    ``eval_noise=True``: its flags say so (``unbiased_modes``) and its claims check both."""
    from kernelattn_core import claims as C
    from kernelattn_core.verify import check_claim, claims_of

    registry = ka.Registry(autoload=True)
    entry = registry.get("ra")
    assert entry.cls.unbiased_modes == ("train",)
    at001 = [c for c in claims_of(entry) if isinstance(c, C.UnbiasedAttention)]
    assert {(c.mode, c.expect, dict(c.options).get("eval_noise", False)) for c in at001} == {
        ("train", "pass", False),
        ("eval", "fail", False),
        ("eval", "pass", True),
    }
    import kernelattn_core.registry as rm

    old = rm._REGISTRY
    rm._REGISTRY = registry
    try:
        eval_default = check_claim(entry, C.UnbiasedAttention(num_features=1, mode="eval", redraws=600), "full")
    finally:
        rm._REGISTRY = old
    assert eval_default.verdict == "fail" and eval_default.numbers["max_abs_z"] > 10


def test_a_class_flagged_unbiased_is_checked_in_eval_mode_too() -> None:
    from kernelattn_core.verify import claims_of

    from . import toy_plugin, verify_plugin

    registry = ka.Registry(autoload=False)
    registry.register_plugin(toy_plugin, "toys")
    registry.register_plugin(verify_plugin, "verify-tests")
    modes = sorted(c.mode for c in claims_of(registry.get("toy-ra")) if c.rule == "AT001")
    assert modes == ["eval", "train"]
