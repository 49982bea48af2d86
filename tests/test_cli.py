"""The command line: plugins and compare."""

from __future__ import annotations

import csv
import io
import json

import pytest

from kernelattn_core.cli.compare import workload
from kernelattn_core.cli.main import main


def test_plugins_table_and_json(use_registry, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for name in ("softmax", "elu", "row", "exact", "feature-map", "toy-prf"):
        assert name in out
    assert main(["plugins", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    builtins = next(p for p in data if p["plugin"] == "builtins")
    assert builtins["distribution"] == "kernelattn-core"
    elu = next(c for c in builtins["classes"] if c["name"] == "elu")
    assert elu["positive"] is True and elu["random"] is False and elu["kind"] == "feature_map"


def test_workload_regimes_have_the_declared_logit_scale() -> None:
    q, k, _ = workload("unit", 512, seed=1)
    assert abs(float(q.norm(dim=-1).mean()) - 1) < 1e-6
    for regime, std in (("gauss-0.5", 0.5), ("gauss-1.0", 1.0)):
        q, k, _ = workload(regime, 512, seed=1)
        logits = (q @ k.transpose(-1, -2)) / 8.0  # / sqrt(64)
        assert abs(float(logits.std()) / std - 1) < 0.05


def test_compare_json_records(use_registry, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["compare", "--estimators", "exact", "elu", "toy-prf", "--budgets", "16", "256", "--seq-len", "64"]
    assert main([*argv, "--format", "json", "--no-progress", "--repeats", "1"]) == 0
    records = json.loads(capsys.readouterr().out)
    # exact and elu have no budget: one record per regime; toy-prf: one per budget and regime
    assert len(records) == 3 * (1 + 1 + 2)
    fields = {"estimator", "regime", "budget", "kernel_rel_mse", "attn_rel_error", "time_ms", "peak_mem_mb", "error"}
    for r in records:
        assert fields <= set(r) and r["error"] is None
    by = {(r["estimator"], r["regime"], r["budget"]): r for r in records}
    assert by[("exact", "gauss-1.0", None)]["attn_rel_error"] < 1e-6
    assert by[("exact", "gauss-1.0", None)]["time_vs_exact"] == 1.0
    small, large = by[("toy-prf", "gauss-1.0", 16)], by[("toy-prf", "gauss-1.0", 256)]
    assert large["kernel_rel_mse"] < small["kernel_rel_mse"]  # more features, better kernel
    assert large["attn_rel_error"] < small["attn_rel_error"]
    assert by[("elu", "unit", None)]["kernel_rel_mse"] is None  # no target kernel


def test_compare_csv_and_table(use_registry, capsys) -> None:  # type: ignore[no-untyped-def]
    base = ["compare", "--estimators", "toy-prf", "--budgets", "16", "--seq-len", "32", "--regime", "unit"]
    assert main([*base, "--format", "csv", "--no-progress", "--repeats", "1"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 1 and rows[0]["estimator"] == "toy-prf" and float(rows[0]["attn_rel_error"]) > 0
    assert main([*base, "--repeats", "1"]) == 0
    captured = capsys.readouterr()
    assert "attn_rel_error" in captured.out and "compare [" in captured.err  # progress on stderr


def test_compare_records_a_failing_estimator_and_goes_on(use_registry, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["compare", "--estimators", "toy-trig", "--budgets", "16", "--seq-len", "16", "--format", "json",
                 "--no-progress", "--repeats", "1", "--regime", "unit"]) == 0  # fmt: skip
    (record,) = json.loads(capsys.readouterr().out)
    assert record["error"] is None or "non-finite" in record["error"]


def test_compare_unknown_estimator_is_a_clear_error(use_registry, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["compare", "--estimators", "nope"]) == 2
    assert "unknown class name 'nope'; available:" in capsys.readouterr().err


def test_help_lists_subcommands(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("plugins", "compare", "verify", "experiment"):
        assert cmd in out
