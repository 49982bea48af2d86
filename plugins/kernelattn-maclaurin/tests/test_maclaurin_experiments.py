"""The papers' experiments run through the CLI at tiny size."""

from __future__ import annotations

import json

from kernelattn_maclaurin.experiments import rmfa_error

from kernelattn_core.toolkit import cli_main as main


def test_rmfa_error_experiment_prints_its_table(capsys):
    code = main(["experiment", "rmfa-error", "--n", "12", "--dims", "8", "--budgets", "4", "16", "--repeats", "3",
                 "--kernels", "exp", "sqrt", "--format", "json"])  # fmt: skip
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["kernel"], r["D"]) for r in rows] == [("exp", 4), ("exp", 16), ("sqrt", 4), ("sqrt", 16)]
    assert all(r["mean_abs_err"] >= 0 and r["median_abs_err"] >= 0 and r["repeats"] == 3 for r in rows)


def test_rmfa_error_falls_with_the_budget_for_every_kernel():
    rows = rmfa_error(n=20, dims=(16,), budgets=(8, 256), repeats=6, mode="released")
    by = {(r["kernel"], r["D"]): r["median_abs_err"] for r in rows}
    for kernel in ("exp", "inv", "logi", "trigh", "sqrt", "polynomial"):
        assert by[(kernel, 256)] < 0.5 * by[(kernel, 8)], (kernel, by)
    assert by[("exp", 8)] == by[("trigh", 8)]  # the same estimator


def test_rmfa_speed_experiment_prints_its_table(capsys):
    code = main(["experiment", "rmfa-speed", "--lengths", "64", "--budgets", "2", "8", "--head-dim", "8",
                 "--heads", "2", "--repeats", "1", "--kernels", "logi"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "speedup" in out and out.count("logi") == 2
