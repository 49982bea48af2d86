"""Shared fixtures of the core test suite."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's kernels are decorated as interpreted or compiled when their module is first
    # imported; set the CPU interpreter before anything (torch.compile's inductor, the
    # backend probe) imports them, whatever order the test files run in
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernelattn_core as ka

_empty = torch.empty


def pytest_configure(config: pytest.Config) -> None:
    """Ignore pytest-benchmark's calibration warning (a loaded CI machine; the numbers are
    still reported) where the plugin is installed; the ini file cannot name a class of a
    package that may be absent."""
    import importlib.util

    if importlib.util.find_spec("pytest_benchmark") is not None:
        config.addinivalue_line("filterwarnings", "ignore::pytest_benchmark.logger.PytestBenchmarkWarning")


def _poisoned_empty(*args, **kwargs):  # type: ignore[no-untyped-def]
    """``torch.empty`` that fills floating tensors with NaN, so code that forgets to
    write an element fails loudly instead of reading stale memory."""
    out = _empty(*args, **kwargs)
    if out.is_floating_point():
        out.fill_(float("nan"))
    return out


@pytest.fixture(autouse=True)
def poison_uninitialised_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "empty", _poisoned_empty)


@pytest.fixture
def registry_with_toys() -> ka.Registry:
    """A registry with the built-ins and the test-only toy plugin (no entry points)."""
    from . import toy_plugin

    reg = ka.Registry(autoload=False)
    reg.register_plugin(toy_plugin, "toys")
    return reg


@pytest.fixture
def use_registry(monkeypatch: pytest.MonkeyPatch, registry_with_toys: ka.Registry) -> ka.Registry:
    """Make the toy registry the process-wide one for the duration of a test."""
    import kernelattn_core.registry as registry_module

    monkeypatch.setattr(registry_module, "_REGISTRY", registry_with_toys)
    return registry_with_toys


def qkv(b=2, h=3, n=13, m=None, d=8, dv=5, dtype=torch.float64, seed=0, scale=1.0):  # type: ignore[no-untyped-def]
    """Random ``q [B,H,N,d]``, ``k [B,H,M,d]``, ``v [B,H,M,dv]``."""
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * scale
    k = torch.randn(b, h, m, d, generator=g, dtype=torch.float64) * scale
    v = torch.randn(b, h, m, dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.fixture
def script_module():  # type: ignore[no-untyped-def]
    """Load ``scripts/<name>.py`` (the measurement scripts are files, not a package) as a module."""
    import importlib.util
    from pathlib import Path

    def load(name: str):  # type: ignore[no-untyped-def]
        path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
