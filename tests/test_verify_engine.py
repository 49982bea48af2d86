"""Engine claims (EN001-EN003), option grids, runtime identities (RT001) and the
``kernelattn verify`` command line: each checker passes a true claim and fails a planted
defect of the kind users meet (an off-by-one causal mask, a normaliser that sees the
future, padded keys counted in the normaliser)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

import kernelattn_core as ka
from kernelattn_core import claims as C
from kernelattn_core.cli.main import main
from kernelattn_core.verify import check_claim, claims_of, expand, plan

from . import toy_plugin, verify_plugin


@pytest.fixture
def reg(monkeypatch: pytest.MonkeyPatch) -> ka.Registry:
    import kernelattn_core.registry as registry_module

    registry = ka.Registry(autoload=False)
    registry.register_plugin(toy_plugin, "toys")
    registry.register_plugin(verify_plugin, "verify-tests")
    monkeypatch.setattr(registry_module, "_REGISTRY", registry)
    return registry


def _run(reg: ka.Registry, name: str, rule: str, level: str = "quick"):  # type: ignore[no-untyped-def]
    entry = reg.get(name)
    (claim,) = [c for c in claims_of(entry) if c.rule == rule and c.expect == "pass"]
    return check_claim(entry, claim, level)


# --------------------------------------------------------------------------- EN001-EN003
@pytest.mark.parametrize("name", ["toy-prf", "toy-trig", "elu", "consistent-prf"])
def test_engine_claims_are_implied_and_pass_for_feature_map_attention(reg: ka.Registry, name: str) -> None:
    for rule in ("EN001", "EN002", "EN003"):
        result = _run(reg, name, rule)
        assert result.verdict == "pass", (rule, result.numbers)
    en001 = _run(reg, name, "EN001")
    assert en001.numbers["max_rel_diff"] < 1e-12 and en001.numbers["modes"] == ["non-causal", "causal"]


def test_en001_fails_a_causal_mask_off_by_one_on_outputs_and_gradients(reg: ka.Registry) -> None:
    result = _run(reg, "drops-own-key", "EN001")
    assert result.verdict == "fail"
    failing = result.numbers["failing"]
    assert all(key.startswith("causal") for key in failing)  # non-causal calls are right
    assert {"causal:out", "causal:q"} <= set(failing)


def test_en002_fails_a_normaliser_that_sees_later_keys(reg: ka.Registry) -> None:
    result = _run(reg, "normalizer-sees-future", "EN002")
    assert result.verdict == "fail"
    assert any("earlier outputs moved" in p for p in result.numbers["problems"])
    assert _run(reg, "normalizer-sees-future", "EN003").verdict == "pass"  # padding is not its defect


def test_en003_fails_padded_keys_counted_in_the_normaliser(reg: ka.Registry) -> None:
    result = _run(reg, "padding-in-normalizer", "EN003")
    assert result.verdict == "fail"
    assert any("padded k get a non-zero gradient" in p for p in result.numbers["problems"])
    assert _run(reg, "padding-in-normalizer", "EN002").verdict == "pass"


def test_en001_full_level_adds_a_longer_sequence_at_the_engines_own_chunk(reg: ka.Registry) -> None:
    quick, full = _run(reg, "toy-prf", "EN001"), _run(reg, "toy-prf", "EN001", "full")
    assert quick.numbers["seq_lens"] == [23] and full.numbers["seq_lens"] == [23, 71]
    assert full.numbers["tensors_compared"] == 2 * quick.numbers["tensors_compared"]


def test_en001_compares_the_gradients_of_learned_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    """A learnable map's parameters are compared too (at trained-like values)."""
    pytest.importorskip("kernelattn_hybrid")
    import kernelattn_core.registry as registry_module

    monkeypatch.setattr(registry_module, "_REGISTRY", None)  # the installed plugins
    claim = C.EngineReference(perturb=0.3, options={"num_heads": 2})
    result = check_claim(ka.get_registry().get("hedgehog"), claim)
    assert result.verdict == "pass", result.numbers
    assert result.numbers["tensors_compared"] == 4 * (4 + 5)  # 4 runs x (out, q, k, v + 5 parameters)


def test_an_estimator_that_is_not_feature_map_attention_needs_a_declared_reference(reg: ka.Registry) -> None:
    assert "EN001" not in {c.rule for c in claims_of(reg.get("toy-ra"))}
    result = check_claim(reg.get("toy-ra"), C.EngineReference())
    assert result.verdict == "fail" and "needs a reference" in result.numbers["error"]


def test_en002_is_refused_for_an_estimator_without_causal_support(reg: ka.Registry) -> None:
    result = check_claim(reg.get("toy-ra"), C.PrefixInvariance())
    assert result.verdict == "fail" and "does not support causal" in result.numbers["error"]


def test_engine_checks_restore_the_global_random_state(reg: ka.Registry) -> None:
    import torch

    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    _run(reg, "toy-prf", "EN003")
    assert torch.equal(torch.random.get_rng_state(), before)


# --------------------------------------------------------------------------- RT001
def test_rt001_passes_the_stated_formula_and_fails_a_wrong_one(reg: ka.Registry) -> None:
    entry = reg.get("identified-prf")
    good, wrong = [c for c in claims_of(entry) if c.rule == "RT001"]
    assert check_claim(entry, good).numbers["max_rel_diff"] == 0.0
    result = check_claim(entry, wrong)
    assert result.verdict == "pass" and result.numbers["checker_verdict"] == "fail"  # a declared control
    assert result.numbers["max_rel_diff"] > 0.1


# --------------------------------------------------------------------------- grids
def test_a_grid_runs_its_first_point_at_quick_level_and_every_point_at_full() -> None:
    claim = C.EngineReference(options={"a": 1}, grid=({"b": 2}, {"a": 3}, {"c": 4}))
    quick, full = expand(claim, "quick"), expand(claim, "full")
    assert [dict(c.options) for c in quick] == [{"a": 1}, {"a": 1, "b": 2}]
    assert [dict(c.options) for c in full] == [{"a": 1}, {"a": 1, "b": 2}, {"a": 3}, {"a": 1, "c": 4}]
    assert all(c.grid == () for c in full)
    assert expand(C.EngineReference()) == [C.EngineReference()]


def test_a_failing_grid_point_fails_the_claim_and_is_named(reg: ka.Registry) -> None:
    entry = reg.get("toy-prf")
    claim = C.EngineReference(grid=({"normalizer": "no-such-normaliser"},))
    result = check_claim(entry, claim)
    assert result.verdict == "fail" and result.numbers["grid_points_failed"] == 1
    assert result.numbers["grid_points_checked"] == 2


def test_plan_with_a_level_lists_every_grid_point(reg: ka.Registry) -> None:
    pytest.importorskip("kernelattn_hybrid")
    import kernelattn_core.registry as registry_module

    registry_module._REGISTRY = None  # the installed plugins
    try:
        quick = [c for e, c in plan(["sliding-window"], level="quick") if c.rule == "EN001"]
        full = [c for e, c in plan(["sliding-window"], level="full") if c.rule == "EN001"]
    finally:
        registry_module._REGISTRY = reg
    assert len(full) > len(quick) >= 2
    assert any(c.options.get("global_tokens", 0) > 0 for c in quick)  # global tokens at quick level too
    assert {c.options.get("window") for c in full} >= {0, 1, 2, 3, 4, 30}


# --------------------------------------------------------------------------- option coverage
def _non_default(cls: type, options: dict) -> set[str]:  # type: ignore[type-arg]
    params = inspect.signature(cls.__init__).parameters
    out = set()
    for key, value in options.items():
        p = params.get(key)
        if p is None or p.default is inspect.Parameter.empty:
            continue
        try:
            differs = bool(value != p.default)
        except Exception:  # a tensor option
            differs = True
        if differs:
            out.add(key)
    return out


def test_every_plugin_estimator_and_feature_map_has_a_claim_on_non_default_options() -> None:
    """Goal of issue 26: each estimator and feature map of the installed plugins has at
    least one claim (at full level, grid points included) that reads an option it is not
    constructed with by default."""
    for module in ("kernelattn_prf", "kernelattn_fourier", "kernelattn_hybrid", "kernelattn_maclaurin"):
        pytest.importorskip(module)
    pytest.importorskip("kernelattn_sampling")
    pytest.importorskip("kernelattn_spectral")
    import kernelattn_core.registry as registry_module

    saved = registry_module._REGISTRY
    registry_module._REGISTRY = None
    try:
        registry = ka.get_registry()
        missing = []
        for entry in registry.entries():
            if entry.plugin in ("builtins", "example") or entry.kind not in ("estimator", "feature_map"):
                continue
            read = set()
            for claim in claims_of(entry):
                for point in expand(claim, "full"):
                    read |= _non_default(entry.cls, dict(getattr(point, "options", {}) or {}))
            if not read:
                missing.append(entry.name)
    finally:
        registry_module._REGISTRY = saved
    assert not missing, f"no claim reads a non-default option of: {missing}"


def test_the_claim_count_table_is_current() -> None:
    """docs/_generated/claim_counts.inc (the counts of docs/spec/claims.rst) is what the
    installed plugins declare; the counts are of real checks: a grid adds checks at full
    level only, and a declared negative control is counted as one."""
    from kernelattn_core.verify import inventory

    for module in ("kernelattn_prf", "kernelattn_fourier", "kernelattn_hybrid", "kernelattn_maclaurin"):
        pytest.importorskip(module)
    pytest.importorskip("kernelattn_sampling")
    pytest.importorskip("kernelattn_spectral")
    registry = ka.Registry(autoload=True)
    quick, full = inventory.claim_counts("quick", registry=registry), inventory.claim_counts("full", registry=registry)
    # the counts are plan()'s: every check verify runs on the shipped plugins, grids expanded
    shipped = [p.name for p in registry.plugins() if p.name in inventory.SHIPPED]
    assert full.total() == len(plan(shipped, registry, "full")) > quick.total() == len(plan(shipped, registry, "quick"))
    assert full.total("hybrid", "EN") > quick.total("hybrid", "EN")  # sliding-window's window modes at full only
    assert full.total(family="AT", controls=True) >= 1 and full.total("builtins", "AT") == 0
    table = Path(__file__).resolve().parents[1] / "docs" / "_generated" / inventory.TABLE_FILE.name  # the checkout's
    assert table.read_text() == inventory.render(registry), (
        f"{table} is not what the installed plugins declare; rewrite it with python -m kernelattn_core.verify.inventory"
    )


# --------------------------------------------------------------------------- command line
def test_verify_help_explains_levels_false_failures_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["verify", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for needle in ("levels:", "quick", "full", "false failures:", "1e-6", "exit codes:", "0  every check", "EN"):
        assert needle in text, needle


def test_verify_rule_filter_and_exit_codes(reg: ka.Registry, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "toy-prf", "--rule", "EN003", "--format", "json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["rule"] for r in records] == ["EN003"]
    assert main(["verify", "padding-in-normalizer", "--rule", "EN003", "--no-progress"]) == 1
    assert "0 passed, 1 failed (quick level" in capsys.readouterr().out
    assert main(["verify", "no-such-thing"]) == 2


def test_verify_lists_deprecations_on_stderr_and_still_passes(
    reg: ka.Registry, capsys: pytest.CaptureFixture[str]
) -> None:
    """A class declaring a deprecated claim form: verify passes (exit 0), the table shows
    the meaningful form, and stderr names the deprecation."""
    from typing import ClassVar

    class DeclaresFM002(toy_plugin.ToyPRF):
        name: ClassVar[str] = "declares-fm002"
        claims: ClassVar[tuple] = (C.PositiveFeatures(),)  # spec 1.0 style on a log-space map

    import types

    mod = types.ModuleType("old_style")
    mod.kernelattn_feature_maps = ka.hookimpl(lambda: [DeclaresFM002])  # type: ignore[attr-defined]
    reg.register_plugin(mod, "old-style")
    assert main(["verify", "declares-fm002", "--rule", "FM002", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "log-feature" in captured.out and "1 passed, 0 failed" in captured.out
    assert "deprecated: FM002 on a log-space map is deprecated since plugin spec 1.1" in captured.err
