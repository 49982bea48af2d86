"""The tutorial's example plugin, installed as a distribution, works end to end.

nox's ``tests`` session installs ``docs/tutorial/kernelattn-example``; elsewhere the
test installs it into a temporary folder with pip, so the tutorial is always tested
as a user would run it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.cli.main import main

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "tutorial" / "kernelattn-example"


@pytest.fixture(scope="module")
def example_installed(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    try:
        metadata.distribution("kernelattn-example")
    except metadata.PackageNotFoundError:
        target = tmp_path_factory.mktemp("site")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(EXAMPLE)],
            check=True,
        )
        sys.path.insert(0, str(target))
        yield
        sys.path.remove(str(target))
        return
    yield


@pytest.fixture
def registry(example_installed, monkeypatch: pytest.MonkeyPatch) -> ka.Registry:  # type: ignore[no-untyped-def]
    import kernelattn_core.registry as registry_module

    monkeypatch.setenv("KERNELATTN_BLOCK_PLUGINS", "")
    reg = ka.Registry(autoload=False)
    reg.load_entry_points()
    monkeypatch.setattr(registry_module, "_REGISTRY", reg)
    return reg


def test_example_is_discovered_through_its_entry_point(registry: ka.Registry) -> None:
    info = registry.plugin_of("example-antithetic")
    assert info.name == "example" and info.distribution == "kernelattn-example"


def test_kernelattn_verify_example(registry: ka.Registry, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "example", "--format", "json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert {r["rule"] for r in records} == {
        "FM001",
        "FM004",
        "FM005",
        "EN001",  # implied for every feature map: the engine against the quadratic reference
        "EN002",
        "EN003",
    }  # log space: positivity holds by construction (no FM002)
    assert all(r["verdict"] == "pass" for r in records)
    assert registry.plugin_of("example-antithetic").spec == "1.1"  # its KERNELATTN_SPEC


def test_conformance_kit_on_example(registry: ka.Registry) -> None:
    from kernelattn_core.testing import conformance_cases

    cases = conformance_cases("example", claims=False)
    assert len(cases) >= 10
    for case in cases:
        case.run("quick")


def test_example_in_kernel_attention(registry: ka.Registry) -> None:
    torch.manual_seed(0)
    layer = ka.KernelAttention(
        64, 4, estimator="example-antithetic", num_features=32, redraw_every=100, batch_first=True
    )
    out, _ = layer(torch.randn(2, 128, 64))
    assert out.shape == (2, 128, 64) and torch.isfinite(out).all()
