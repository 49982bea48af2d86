"""The command line: plugins and compare."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys

import pytest

from kernelattn_core.cli.compare import default_estimators, quartiles, summary, workload
from kernelattn_core.cli.main import SUBCOMMANDS, main

FAST = ["--no-progress", "--min-run-time", "0.001"]


def test_plugins_table_and_json(use_registry, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for name in ("softmax", "elu", "row", "exact", "feature-map", "toy-prf", "aliases"):
        assert name in out
    assert main(["plugins", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    builtins = next(p for p in data if p["plugin"] == "builtins")
    assert builtins["distribution"] == "kernelattn-core"
    elu = next(c for c in builtins["classes"] if c["name"] == "elu")
    assert elu["positive"] is True and elu["random"] is False and elu["kind"] == "feature_map"
    assert elu["aliases"] == ["linear-elu"]


def test_plugins_table_shows_the_aliases_people_search_for(capsys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("kernelattn_prf")
    pytest.importorskip("kernelattn_maclaurin")
    assert main(["plugins"]) == 0
    rows = {line.split()[4]: line for line in capsys.readouterr().out.splitlines()[2:] if len(line.split()) > 4}
    assert "macformer" in rows["schoenbat"]
    assert "performer" in rows["prf"] and "favor+" in rows["prf"]


def test_workload_regimes_have_the_declared_logit_scale() -> None:
    q, k, _ = workload("unit", 512, seed=1)
    assert abs(float(q.norm(dim=-1).mean()) - 1) < 1e-6
    for regime, std in (("gauss-0.5", 0.5), ("gauss-1.0", 1.0)):
        q, k, _ = workload(regime, 512, seed=1)
        logits = (q @ k.transpose(-1, -2)) / 8.0  # / sqrt(64)
        assert abs(float(logits.std()) / std - 1) < 0.05


def test_compare_json_records(use_registry, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["compare", "--estimators", "exact", "elu", "toy-prf", "--budgets", "16", "256", "--seq-len", "64"]
    assert main([*argv, "--format", "json", "--regime", "all", "--seeds", "0", "1", "2", *FAST]) == 0
    records = json.loads(capsys.readouterr().out)
    # the baseline, exact and elu have no budget: one record per regime; toy-prf: one per budget and regime
    assert len(records) == 4 * (1 + 1 + 1 + 2)
    regimes = [r["regime"] for r in records if r["estimator"] == "baseline:mean-v"]
    assert regimes == ["unit", "gauss-0.5", "gauss-1.0", "peaked"]
    for r in records:
        base = next(b for b in records if b["estimator"] == "baseline:mean-v" and b["regime"] == r["regime"])
        assert records.index(base) <= records.index(r)  # the baseline comes first in its workload
        if r is not base:  # judged against the baseline's error on the same references
            assert r["mean_v_error"] == pytest.approx(base["attn_rel_error"])
            assert r["beats_mean_v"] == (r["attn_rel_error"] < base["attn_rel_error"])
    fields = {"estimator", "regime", "budget", "target", "kernel_rel_mse", "attn_rel_error", "attn_rel_error_iqr"}
    for r in records:
        assert fields <= set(r) and r["error"] is None and r["seeds"] == [0, 1, 2]
        assert r["attn_rel_error_q1"] <= r["attn_rel_error"] <= r["attn_rel_error_q3"]
        assert r["attn_rel_error_iqr"] == pytest.approx(r["attn_rel_error_q3"] - r["attn_rel_error_q1"])
        assert r["time_ms"] > 0 and r["target"] == "softmax"
    by = {(r["estimator"], r["regime"], r["budget"]): r for r in records}
    assert by[("exact", "gauss-1.0", None)]["attn_rel_error"] < 1e-6
    assert by[("exact", "gauss-1.0", None)]["time_vs_exact"] == 1.0
    small, large = by[("toy-prf", "gauss-1.0", 16)], by[("toy-prf", "gauss-1.0", 256)]
    assert large["kernel_rel_mse"] < small["kernel_rel_mse"]  # more features, better kernel
    assert large["attn_rel_error"] < small["attn_rel_error"]
    assert small["attn_rel_error_iqr"] > 0  # three seeds draw three different feature sets
    assert by[("elu", "unit", None)]["kernel_rel_mse"] is None  # no target kernel


def test_quartiles_and_summary_are_like_for_like() -> None:
    assert quartiles([]) is None
    assert quartiles([2.0]) == (2.0, 2.0, 2.0)
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)
    rows = [
        {"estimator": "a", "regime": "r", "seq_len": 8, "budget": 16, "target": "softmax", "attn_rel_error": 0.5},
        {"estimator": "b", "regime": "r", "seq_len": 8, "budget": 16, "target": "softmax", "attn_rel_error": 0.2},
        {"estimator": "g", "regime": "r", "seq_len": 8, "budget": 16, "target": "gaussian", "attn_rel_error": 0.01},
        {"estimator": "exact", "regime": "r", "seq_len": 8, "budget": None, "target": "softmax", "attn_rel_error": 0},
        {"estimator": "c", "regime": "r", "seq_len": 8, "budget": None, "target": "softmax", "attn_rel_error": 0.1},
    ]
    for r in rows:
        r.update(error=None, time_ms=1.0)
    best = {(b["budget"], b["target"]): b["best"] for b in summary(rows)}
    # c has no budget and competes at 16; exact is the reference; gaussian rows only compete with gaussian rows
    assert best == {(16, "softmax"): "c", (16, "gaussian"): "g"}


def test_compare_csv_file_streamed_table_and_summary(use_registry, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out_file = tmp_path / "res" / "compare.csv"
    base = ["compare", "--estimators", "exact", "toy-prf", "--budgets", "16", "64", "--seq-len", "32", "--seeds", "0"]
    assert main([*base, "--regime", "unit", "--output", str(out_file), *FAST]) == 0
    captured = capsys.readouterr()
    rows = list(csv.DictReader(io.StringIO(out_file.read_text())))
    assert [(r["estimator"], r["budget"]) for r in rows] == [
        ("baseline:mean-v", ""),
        ("exact", ""),
        ("toy-prf", "16"),
        ("toy-prf", "64"),
    ]
    assert float(rows[2]["attn_rel_error"]) > 0 and rows[2]["target"] == "softmax"
    lines = captured.out.splitlines()
    assert lines[0].split()[:3] == ["estimator", "regime", "budget"]  # the streamed table
    assert sum(line.startswith("toy-prf") for line in lines) == 2  # two streamed rows
    summary = [line for line in lines if line.startswith("unit")]
    assert len(summary) == 2  # one entry per budget: toy-prf where it beats the baseline, else none
    for row, line in zip(rows[2:], summary):
        assert (" toy-prf " in line) == (row["beats_mean_v"] == "True"), (row, line)
        assert ("none beats mean-v" in line) == (row["beats_mean_v"] == "False")
    assert "best estimator per budget" in captured.out
    assert "compare [" not in captured.err  # stderr is not a terminal: no progress in logs


def test_compare_csv_to_stdout_is_only_csv(use_registry, capsys) -> None:  # type: ignore[no-untyped-def]
    base = ["compare", "--estimators", "toy-prf", "--budgets", "16", "--seq-len", "32", "--regime", "unit"]
    assert main([*base, "--format", "csv", "--seeds", "0", *FAST]) == 0
    captured = capsys.readouterr()
    rows = list(csv.DictReader(io.StringIO(captured.out)))
    assert [r["estimator"] for r in rows] == ["baseline:mean-v", "toy-prf"] and float(rows[1]["attn_rel_error"]) > 0
    assert "best estimator" in captured.err  # the summary goes to stderr, stdout stays parseable


def test_compare_plot_svg_shows_every_estimator(use_registry, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    path = tmp_path / "compare.svg"
    argv = ["compare", "--estimators", "exact", "toy-prf", "elu", "--budgets", "16", "64", "--seq-len", "32", "64"]
    assert main([*argv, "--seeds", "0", "1", "--plot", str(path), *FAST]) == 0
    assert f"plot written to {path}" in capsys.readouterr().out
    svg = path.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    for text in ("toy-prf", "elu", "relative output error", "sequence length N", "budget"):
        assert text in svg, text
    png = tmp_path / "compare.png"
    assert main([*argv[:5], "--seq-len", "32", "--seeds", "0", "--plot", str(png), *FAST]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_compare_plot_errors_are_clear_and_early(use_registry, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    argv = ["compare", "--estimators", "toy-prf", "--budgets", "16", "--seq-len", "16", *FAST]
    assert main([*argv, "--plot", "figure.gif"]) == 2
    err = capsys.readouterr().err
    assert "--plot: expected a file ending in .png, .svg, .pdf, got 'figure.gif'" in err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the extra were not installed
    assert main([*argv, "--plot", "figure.png"]) == 2
    captured = capsys.readouterr()
    assert "kernelattn-core[plot]" in captured.err and captured.out == ""  # nothing ran


def test_compare_records_a_failing_estimator_and_goes_on(use_registry, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["compare", "--estimators", "toy-trig", "--budgets", "16", "--seq-len", "16", "--format", "json",
                 "--seeds", "0", "--regime", "unit", *FAST]) == 0  # fmt: skip
    baseline, record = json.loads(capsys.readouterr().out)
    assert baseline["estimator"] == "baseline:mean-v" and baseline["error"] is None
    assert record["error"] is None or "non-finite" in record["error"]
    if record["error"]:
        assert record["beats_mean_v"] is None  # a failed row is never judged


def test_compare_spends_a_budget_per_query_as_tasks_does(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``--budgets 16`` gave the cos/sin maps 16 frequencies (32 features, twice prf's state);
    now every row's feature dimension is the budget, as in ``kernelattn tasks``, and the
    row says what was built. Repeated flags add up (argparse kept the last one)."""
    pytest.importorskip("kernelattn_prf")
    pytest.importorskip("kernelattn_fourier")
    import kernelattn_core as ka

    out = tmp_path / "c.json"
    argv = ["compare", "--workload", "synthetic", "--estimators", "prf", "--estimators", "rfa", "--budgets", "16"]
    assert main([*argv, "--seq-len", "32", "--seeds", "0", "--regime", "unit", *FAST, "--output", str(out)]) == 0
    rows = {r["estimator"]: r for r in json.loads(out.read_text()) if r["budget"] == 16}
    assert set(rows) == {"prf", "rfa"}  # both flags kept
    for name, row in rows.items():
        est = ka.create(name, **row["options"])
        est.feature_map.build(64)
        assert est.feature_map.feature_dim == 16, name
    assert rows["rfa"]["options"] == {"num_features": 8} and rows["prf"]["options"] == {"num_features": 16}
    assert main(["compare", "--workload", "synthetic", "--estimators", "prf", "--output", str(tmp_path)]) == 2
    assert "--output: expected a file name, got the folder" in capsys.readouterr().err
    # a spec as kernelattn tasks takes it ("unknown class name 'prf:num_features=32'"): its own
    # size is not swept; its other options join the budget's
    argv = ["compare", "--workload", "synthetic", "--estimators", "prf:num_features=32", "rfa:orthogonal=True"]
    assert main([*argv, "--budgets", "16", "--seq-len", "32", "--seeds", "0", "--regime", "unit", *FAST,
                 "--output", str(out)]) == 0  # fmt: skip
    rows = {r["estimator"]: r for r in json.loads(out.read_text())}
    assert (rows["prf:num_features=32"]["budget"], rows["prf:num_features=32"]["options"]) == (
        None,
        {"num_features": 32},
    )
    assert rows["rfa:orthogonal=True"]["options"] == {"num_features": 8, "orthogonal": True}
    assert all(r["error"] is None for r in rows.values())
    assert main(["compare", "--workload", "synthetic", "--estimators", "prf:nosuch=1"]) == 2
    assert "estimator 'prf:nosuch=1': create: unknown option(s) ['nosuch']" in capsys.readouterr().err


def test_compare_unknown_estimator_is_a_clear_error(use_registry, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["compare", "--estimators", "nope"]) == 2
    assert "unknown class name 'nope'; available:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--seq-len", "-4"], "seq_len: expected an integer >= 1, got -4"),
        (["--seq-len", "0"], "seq_len: expected an integer >= 1, got 0"),
        (["--budgets", "0"], "budgets: expected an integer >= 1, got 0"),
        (["--seeds", "-1"], "seeds: expected an integer >= 0, got -1"),
        (["--min-run-time", "-1"], "min_run_time: expected a finite number of seconds > 0, got -1.0"),
    ],
)
def test_compare_refuses_bad_numbers_before_any_row(use_registry, capsys, argv: list[str], match: str) -> None:  # type: ignore[no-untyped-def]
    """A negative length crashed inside torch; a budget of 0 failed every row with exit 0."""
    assert main(["compare", "--workload", "synthetic", "--estimators", "toy-trig", *argv]) == 2
    assert match in capsys.readouterr().err


def test_verify_refuses_an_unknown_rule(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["verify", "--rule", "NOSUCH", "elu"]) == 2  # it ran nothing: "0 passed, 0 failed", exit 0
    err = capsys.readouterr().err
    assert "--rule: ['NOSUCH'] is not a rule of the selected classes; theirs are ['EN001'" in err


def test_default_estimators_leave_the_quadratic_ones_out() -> None:
    pytest.importorskip("kernelattn_sampling")
    from kernelattn_core import get_registry

    linear, everything = default_estimators(), default_estimators(quadratic=True)
    assert linear[0] == "exact" and "feature-map" not in everything
    assert "ra" not in linear and "ra" in everything and "lara" in linear
    reg = get_registry()
    for name in linear[1:]:
        entry = reg.get(name)
        assert entry.kind == "feature_map" or entry.cls.linear, name


def test_default_estimators_leave_causal_only_ones_out_of_a_bidirectional_compare() -> None:
    pytest.importorskip("kernelattn_fourier")
    assert "rfa-gate" not in default_estimators(causal=False)
    assert "rfa-gate" in default_estimators(causal=True) and "rfa-gate" in default_estimators()
    assert "rfa" in default_estimators(causal=False)


def test_help_lists_subcommands(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("plugins", "compare", "verify", "experiment"):
        assert cmd in out


@pytest.mark.parametrize("argv", [[], *([name] for name in SUBCOMMANDS)])
def test_help_imports_neither_torch_nor_plugins(argv: list[str]) -> None:
    # experiment included (issue #17): its names come from the plugins, so its help points
    # to --list instead of importing them
    code = (
        "import sys\nfrom kernelattn_core.cli.main import main\n"
        f"try:\n    main({[*argv, '--help']!r})\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('kernelattn_') and '.' not in m)\n"
        "print('HEAVY', heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert "usage: kernelattn" in result.stdout
    assert "HEAVY ['kernelattn_core']" in result.stdout, result.stdout[-500:]


def test_compare_workload_auto_takes_real_attention_when_the_hf_extra_is_installed(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    import kernelattn_core.cli.compare as compare

    calls: list[dict] = []

    def fake_run(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs)
        return []

    monkeypatch.setattr(compare, "run_compare", fake_run)
    monkeypatch.setattr(compare, "minilm_available", lambda: True)
    assert main(["compare", "--no-progress"]) == 0
    assert calls[-1]["workload_name"] == "minilm"
    assert "workload: minilm" in capsys.readouterr().err
    assert main(["compare", "--no-progress", "--regime", "unit"]) == 0  # a synthetic option: synthetic
    assert calls[-1]["workload_name"] == "synthetic" and calls[-1]["regimes"] == ["unit"]
    monkeypatch.setattr(compare, "minilm_available", lambda: False)
    assert main(["compare", "--no-progress"]) == 0
    assert calls[-1]["workload_name"] == "synthetic" and calls[-1]["seq_len"] == [256]
    assert "pip install 'kernelattn-core[hf]'" in capsys.readouterr().err


def test_compare_summary_names_a_best_only_among_rows_that_beat_the_baseline() -> None:
    rows = [
        {
            "estimator": "baseline:mean-v",
            "regime": "r",
            "seq_len": 8,
            "budget": None,
            "target": "softmax",
            "attn_rel_error": 0.4,
            "time_ms": 1.0,
            "error": None,
        },
        {
            "estimator": "a",
            "regime": "r",
            "seq_len": 8,
            "budget": 16,
            "target": "softmax",
            "attn_rel_error": 0.5,
            "beats_mean_v": False,
            "time_ms": 1.0,
            "error": None,
        },
        {
            "estimator": "b",
            "regime": "r",
            "seq_len": 8,
            "budget": 64,
            "target": "softmax",
            "attn_rel_error": 0.3,
            "beats_mean_v": True,
            "time_ms": 1.0,
            "error": None,
        },
    ]
    best = {r["budget"]: r["best"] for r in summary(rows)}
    assert best == {16: "none beats mean-v", 64: "b"}


def test_compare_summary_without_budgeted_rows_and_with_softmax_as_a_reference() -> None:
    """Only estimators without a budget: the winner was never placed (it looped over no
    budgets), so the summary said "none beats mean-v" beside a row marked as beating it;
    ``softmax`` is exact attention under its kernel's name: a reference, like ``exact``."""

    def row(name: str, error: float, beats: bool | None) -> dict:
        return {"estimator": name, "regime": "r", "seq_len": 8, "budget": None, "target": "softmax",
                "attn_rel_error": error, "beats_mean_v": beats, "time_ms": 1.0, "error": None}  # fmt: skip

    rows = [row("baseline:mean-v", 0.4, None), row("softmax", 0.0, True), row("elu", 0.3, True)]
    assert [(r["budget"], r["best"]) for r in summary(rows)] == [(None, "elu")]
    assert [r["best"] for r in summary(rows[:2])] == ["none beats mean-v"]


def test_compare_refuses_synthetic_options_on_the_minilm_workload(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["compare", "--workload", "minilm", "--regime", "peaked", "--estimators", "elu"]) == 2
    assert "--regime/--seq-len: they choose the synthetic workload" in capsys.readouterr().err


def test_convert_budget_and_window_conflicting_with_an_option_are_refused() -> None:
    import argparse

    from kernelattn_core.cli.convert_cmd import estimator_options
    from kernelattn_core.errors import InputError

    args = argparse.Namespace(option=["num_features=8"], budget=16, window=None)
    with pytest.raises(InputError, match="--budget: 16 conflicts with --option num_features=8; give one of them"):
        estimator_options(args)  # 16 was used, silently
    args = argparse.Namespace(option=["window=4", "num_features=16"], budget=16, window=4)
    assert estimator_options(args) == {"window": 4, "num_features": 16}  # the same answer twice is fine


def test_version(capsys) -> None:  # type: ignore[no-untyped-def]
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])  # it said "the following arguments are required: COMMAND"
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kernelattn {version('kernelattn-core')}"


def test_csv_cells_holding_a_dict_are_json(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["plugins", "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    elu = next(r for r in rows if r["name"] == "elu")
    assert json.loads(elu["flags"])["positive"] is True  # it was Python's repr: {'positive': True, ...}
