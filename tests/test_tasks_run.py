"""``run_tasks`` and ``kernelattn tasks``: references in every table, reasons for rows that
cannot run, the derived columns, the CLI's outputs and figure."""

from __future__ import annotations

import json

import pytest

from kernelattn_core.cli.main import main
from kernelattn_core.errors import InputError
from kernelattn_core.tasks import NO_MIXING, TASKS
from kernelattn_core.tasks.run import (
    LEARNED_MARGIN,
    PRESETS,
    _relate,
    budget_options,
    default_estimators,
    run_tasks,
    seeds_table,
)

SMALL = {"eval_size": 32, "curve_size": 16, "eval_every": 2, "d_model": 32}


def test_every_table_has_its_references_first_and_reasons_for_rows_that_cannot_run() -> None:
    streamed: list[dict] = []
    records = run_tasks(
        ["mqar", "listops"],
        ["elu", "lara", "rfa-gate", "prf"],
        [8, 16],
        steps=4,
        progress=False,
        on_record=streamed.append,
        recipe=SMALL,
    )
    assert streamed == records
    for task in ("mqar", "listops"):
        rows = [r for r in records if r["task"] == task]
        assert [r["estimator"] for r in rows[:2]] == ["exact", NO_MIXING]
        assert [r["budget"] for r in rows if r["estimator"] == "prf"] == [8, 16]
        assert [r["budget"] for r in rows if r["estimator"] == "elu"] == [None]
        exact = rows[0]
        assert exact["time_vs_exact"] == 1.0 and exact["learned"] is None and exact["ceiling"] == exact["accuracy"]
        for r in rows:
            assert r["floor"] == rows[1]["accuracy"]
    by = {(r["task"], r["estimator"], r["budget"]): r for r in records}
    assert by[("mqar", "lara", 8)]["error"].startswith("non-causal only")
    assert by[("mqar", "lara", 8)]["accuracy"] is None
    assert by[("listops", "rfa-gate", 8)]["error"].startswith("causal only")
    assert by[("listops", "lara", 8)]["error"] is None and 0 <= by[("listops", "lara", 8)]["accuracy"] <= 1
    assert by[("mqar", "prf", 16)]["options"] == {"num_features": 16}


def test_parallel_jobs_give_the_sequential_results_in_the_same_order() -> None:
    """``jobs=2`` trains each (row, seed) in a spawned process: every seeded number equals
    the sequential run's (both with one thread per run: another thread count rounds the
    reductions differently), rows come back in plan order, a row that cannot run keeps its reason."""
    import torch

    kwargs = {"steps": 3, "progress": False, "recipe": SMALL, "seeds": [0, 1]}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the workers get 2 // jobs = 1 thread each
    try:
        streamed: list[dict] = []
        two = run_tasks(["mqar"], ["elu", "prf", "lara"], [8], jobs=2, on_record=streamed.append, **kwargs)
        torch.set_num_threads(1)
        one = run_tasks(["mqar"], ["elu", "prf", "lara"], [8], **kwargs)
    finally:
        torch.set_num_threads(threads)
    assert [(r["estimator"], r["budget"]) for r in two] == [(r["estimator"], r["budget"]) for r in one]
    assert sorted(map(id, streamed)) == sorted(map(id, two))
    for a, b in zip(one, two, strict=True):
        for key in ("accuracies", "curves", "first_loss", "last_loss", "error", "floor", "ceiling", "learned"):
            assert a.get(key) == b.get(key), (a["estimator"], key)
    assert two[-1]["error"].startswith("non-causal only")
    with pytest.raises(InputError, match="jobs: expected a positive int"):
        run_tasks(["mqar"], ["elu"], jobs=0, progress=False)


def test_relate_marks_rows_that_do_not_beat_the_floor_and_reads_steps_to_90() -> None:
    exact = {"estimator": "exact", "accuracy": 0.8, "time_per_step_ms": 10.0, "curves": []}
    floor = {"estimator": NO_MIXING, "accuracy": 0.1, "curves": []}
    fast = {
        "estimator": "a",
        "accuracy": 0.7,
        "time_per_step_ms": 20.0,
        "curves": [[(10, 0.5), (20, 0.73), (30, 0.7)], [(10, 0.75), (20, 0.8), (30, 0.8)]],
    }
    flat = {
        "estimator": "b",
        "accuracy": 0.1 + LEARNED_MARGIN / 2,
        "time_per_step_ms": 5.0,
        "curves": [[(10, 0.1)], [(10, 0.1)]],
    }
    for r in (fast, flat):
        _relate(r, exact, floor)
    assert fast["learned"] is True and fast["steps_to_90"] == 10 and fast["time_vs_exact"] == 2.0
    assert fast["vs_floor"] == pytest.approx(0.6)
    assert flat["learned"] is False and flat["steps_to_90"] is None
    half = {"estimator": "c", "accuracy": 0.5, "curves": [[(10, 0.8)], [(10, 0.1)], [(10, 0.1)]]}
    _relate(half, exact, floor)
    assert half["steps_to_90"] is None  # one seed of three got there: no median step
    # a ceiling that learned nothing (a short run): no row "reaches 90 % of it" at chance
    untrained = {**exact, "accuracy": 0.1 + LEARNED_MARGIN / 2}
    lucky = {"estimator": "d", "accuracy": 0.12, "curves": [[(5, 0.12)]]}  # >= 0.9 * 0.125: "reached" before
    _relate(lucky, untrained, floor)
    assert lucky["steps_to_90"] is None
    _relate(lucky, exact, floor)
    assert lucky["steps_to_90"] is None and fast["steps_to_90"] == 10  # the learned ceiling's rule is unchanged


def test_sliding_window_spends_the_same_total_budget() -> None:
    for budget in (16, 64, 256):
        causal = budget_options("sliding-window", budget, True)
        assert causal["window"] + causal["num_features"] == budget
        both = budget_options("sliding-window", budget, False)
        assert budget - 1 <= 2 * both["window"] + 1 + both["num_features"] <= budget
        assert both["num_features"] % 2 == 0
    assert budget_options("prf", 64, True) == {"num_features": 64}
    assert budget_options("elu", 64, True) == {}


def test_every_budgeted_feature_map_gets_the_budget_as_its_feature_dimension() -> None:
    """Equal budgets mean equal state widths: the cos/sin maps (rfa, gmm-rks), whose
    ``num_features`` counts frequencies with two features each, get half as many."""
    import kernelattn_core as ka

    halved = set()
    for name in default_estimators():
        options = budget_options(name, 64, True)
        fm = getattr(ka.create(name, **options), "feature_map", None)
        if fm is None or "window" in options or not options:  # no feature map, split budget, no budget (elu)
            continue
        fm.build(32)
        assert fm.feature_dim == 64, (name, options, fm.feature_dim)
        if options["num_features"] == 32:
            halved.add(name)
    assert {"rfa", "gmm-rks"} <= halved, halved  # without the probe they would carry 128 features
    assert budget_options("fastfood-prf", 16, True) == {"num_features": 16}  # refused size: the run reports it


def test_seeds_table_has_the_papers_layout() -> None:
    records = [
        {"task": "listops", "estimator": "exact", "budget": None, "accuracy": 0.4, "time_vs_exact": 1.0},
        {"task": "mqar", "estimator": "exact", "budget": None, "accuracy": 1.0, "time_vs_exact": 1.0},
        {"task": "listops", "estimator": "prf", "budget": 64, "accuracy": 0.3, "time_vs_exact": 2.0},
        {"task": "mqar", "estimator": "prf", "budget": 64, "accuracy": None, "time_vs_exact": None},
    ]
    rows = {r["estimator"]: r for r in seeds_table(records)}
    assert rows["exact"]["avg acc"] == pytest.approx(70.0) and rows["exact"]["listops acc"] == pytest.approx(40.0)
    assert rows["prf"]["avg acc"] is None  # an average over a missing task would mislead


def test_cli_json_csv_and_plot(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    out, plot = tmp_path / "t.json", tmp_path / "t.svg"
    argv = [
        "tasks",
        "--task",
        "mqar",
        "--estimator",
        "elu",
        "--estimator",
        "prf",
        "--budget",
        "8",
        "--steps",
        "2",
        "--no-progress",
        "--output",
        str(out),
        "--plot",
        str(plot),
    ]
    assert main(argv) == 0
    records = json.loads(out.read_text())
    assert [r["estimator"] for r in records] == ["exact", NO_MIXING, "elu", "prf"]
    assert all(r["steps"] == 2 and r["scale"] == "quick" for r in records)
    svg = plot.read_text()
    assert "mqar" in svg and "accuracy against time" in svg and "exact (ceiling)" in svg
    streamed = capsys.readouterr().out.splitlines()  # the table streamed row by row
    assert streamed[0].split()[:3] == ["task", "estimator", "budget"]
    assert [line.split()[1] for line in streamed if line.startswith("mqar")] == ["exact", NO_MIXING, "elu", "prf"]
    assert streamed[-1].startswith("plot written to")
    assert main([*argv[:-4], "--format", "csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("task,estimator,budget,accuracy") and len(lines) == 5


def test_cli_streamed_columns_fit_long_estimator_names(capsys) -> None:  # type: ignore[no-untyped-def]
    long = "sliding-window:init=prf"  # longer than the default column
    assert main(["tasks", "--task", "mqar", "--estimator", long, "--budget", "8", "--steps", "1", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, row = lines[0], next(line for line in lines if long in line)
    assert row.index(" 8 ") + 1 == header.index("budget")  # the budget sits under its header


def test_cli_refuses_bad_arguments_before_training(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["tasks", "--budget", "0"]) == 2
    assert "--budget: expected a positive integer, got 0" in capsys.readouterr().err
    assert main(["tasks", "--plot", "x.txt", "--steps", "1"]) == 2
    assert "--plot: expected a file ending in" in capsys.readouterr().err
    assert main(["tasks", "--estimator", "nope", "--steps", "1", "--no-progress"]) == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tasks", "--task", "imdb"])
    # an estimator option error fails the command before any training (it failed its row
    # only, exit 0, after the references had trained)
    assert main(["tasks", "--estimator", "elu:nosuch=1", "--steps", "1", "--no-progress"]) == 2
    assert "estimator 'elu:nosuch=1': create: unknown option(s) ['nosuch']" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"estimators": ["prf:num_features=abc"]}, r"estimator 'prf:num_features=abc': num_features: expected an int"),
        ({"recipe": {"nosuch": 1}}, r"recipe: unknown field\(s\) \['nosuch'\]; the fields are \['batch_size'"),
        ({"recipe": {"lr": -1}}, r"lr: expected a finite number > 0, got -1"),
        ({"recipe": {"batch_size": 0}}, r"batch_size: expected an integer >= 1, got 0"),
        ({"seeds": [1.5]}, r"seeds: expected an integer >= 0, got 1.5"),
    ],
)
def test_run_tasks_refuses_bad_arguments_before_training(kwargs: dict, match: str) -> None:
    args = {"tasks": ["mqar"], "estimators": ["elu"], "steps": 1, "progress": False, **kwargs}
    with pytest.raises(InputError, match=match):
        run_tasks(**args)


def test_run_tasks_takes_one_name_as_a_list_of_one() -> None:
    records = run_tasks("mqar", "elu", steps=1, progress=False)  # not the characters 'm', 'q', ...
    assert [r["estimator"] for r in records] == ["exact", "baseline:no-mixing", "elu"]
    assert all(r["task"] == "mqar" and r["error"] is None for r in records)


def test_cli_lists_every_task_and_preset() -> None:
    from kernelattn_core.cli import tasks_cmd

    assert tasks_cmd.TASK_NAMES == tuple(TASKS)
    assert tasks_cmd.PRESET_NAMES == tuple(PRESETS)


def test_preset_estimators_are_registered() -> None:
    from kernelattn_core import get_registry

    for plugin in (
        "kernelattn_prf",
        "kernelattn_fourier",
        "kernelattn_maclaurin",
        "kernelattn_spectral",
        "kernelattn_sampling",
        "kernelattn_hybrid",
    ):
        pytest.importorskip(plugin)
    from kernelattn_core.tasks.run import parse_spec

    reg = get_registry()
    for preset in PRESETS.values():
        for spec in preset.estimators:
            name, options = parse_spec(spec)
            if name != "exact":
                cls = reg.get(name).cls
                if name in ("hedgehog", "sliding-window"):
                    assert set(options) <= {"init", "feature_map"}, spec
                else:
                    assert options == {}, spec  # paper estimators run as users get them
                assert cls is not None
        assert set(preset.tasks) <= set(TASKS)


def test_estimator_specs_carry_options() -> None:
    from kernelattn_core.errors import InputError
    from kernelattn_core.tasks.run import parse_spec

    assert parse_spec("prf") == ("prf", {})
    assert parse_spec("hedgehog:init=prf,tied=True") == ("hedgehog", {"init": "prf", "tied": True})
    assert parse_spec("sliding-window: window=8 , feature_map=prf") == (
        "sliding-window",
        {"window": 8, "feature_map": "prf"},
    )
    for bad in ("", "prf:init", "prf:=3", "prf:a b=1"):
        with pytest.raises(InputError, match="estimator: expected"):
            parse_spec(bad)
    records = run_tasks(["mqar"], ["hedgehog:init=prf", "hedgehog"], [8], steps=2, progress=False, recipe=SMALL)
    by = {r["estimator"]: r for r in records}
    assert by["hedgehog:init=prf"]["options"] == {"num_features": 8, "init": "prf"}
    assert by["hedgehog"]["options"] == {"num_features": 8}


def test_a_spec_that_sets_its_own_size_runs_once_without_a_budget_label() -> None:
    """``prf:num_features=128 --budget 16 --budget 64`` ran two rows labelled 16 and 64, both
    with 128 features; ``sliding-window:window=8`` at budget 64 ran 8 + 48 keys labelled 64."""
    from kernelattn_core.tasks.run import has_budget

    assert has_budget("prf") and has_budget("sliding-window:init=prf") and has_budget("hedgehog:init=prf")
    assert not has_budget("prf:num_features=16") and not has_budget("sliding-window:window=8")
    records = run_tasks(["mqar"], ["prf:num_features=16", "prf"], [8, 16], steps=1, progress=False, recipe=SMALL)
    own = [r for r in records if r["estimator"] == "prf:num_features=16"]
    assert [(r["budget"], r["options"]) for r in own] == [(None, {"num_features": 16})]
    swept = [(r["budget"], r["options"]) for r in records if r["estimator"] == "prf"]
    assert swept == [(8, {"num_features": 8}), (16, {"num_features": 16})]  # negative control: swept


def test_the_budget_probe_leaves_the_callers_random_state_alone() -> None:
    """features_per_unit builds the map to count its features; its draws moved the global
    generator, so compare's rows after ``torch.manual_seed`` depended on whether the probe
    was cached (the first seed's draws differed from a later call's)."""
    import torch

    from kernelattn_core.tasks.run import features_per_unit

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert features_per_unit("prf", 32, 77) == 1  # not cached: it builds and draws
    assert torch.equal(torch.rand(3), expected)


def test_seeds_and_budgets_take_one_int_and_refuse_a_seed_twice() -> None:
    """``--seeds 0 0 --jobs 2`` lost every row (keyed by seed, the runs never completed) and
    exited 0; with one job the copies made a standard deviation of identical runs."""
    records = run_tasks("mqar", "elu", budgets=8, seeds=3, steps=1, progress=False, recipe=SMALL)
    assert {tuple(r["seeds"]) for r in records} == {(3,)}
    with pytest.raises(InputError, match=r"seeds: expected distinct seeds .*got \[0\] more than once"):
        run_tasks("mqar", "elu", seeds=[0, 1, 0], steps=1, progress=False)


def test_cli_repeated_seeds_flags_add_up_and_bad_output_paths_fail_first(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "r.json"
    argv = ["tasks", "--task", "mqar", "--estimator", "elu", "--steps", "1", "--no-progress"]
    assert main([*argv, "--seeds", "0", "--seeds", "1", "--output", str(out)]) == 0
    assert {tuple(r["seeds"]) for r in json.loads(out.read_text())} == {(0, 1)}  # argparse kept only [1]
    blocker = tmp_path / "afile"
    blocker.write_text("")
    for flag, path, message in (
        ("--output", tmp_path, "--output: expected a file name, got the folder"),
        ("--output", blocker / "x.json", "--output: expected a path in a folder, got"),
        ("--plot", blocker / "x.png", "--plot: expected a path in a folder, got"),
    ):
        assert main([*argv, flag, str(path)]) == 2, flag
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert not any(tmp_path.glob("**/*.png"))


def test_quadratic_estimators_run_at_their_own_setting_not_the_budget() -> None:
    pytest.importorskip("kernelattn_sampling")
    from kernelattn_core.tasks.run import has_budget

    assert not has_budget("ra") and not has_budget("ra-biased") and has_budget("lara") and has_budget("prf")
    assert budget_options("ra", 64, True) == {}


def test_cli_table_prints_each_float_column_in_its_format(capsys) -> None:  # type: ignore[no-untyped-def]
    """Accuracies with three decimals, the difference to the floor signed, times with one,
    the ratio to exact with two (the generic 4 significant digits printed 0.009888 beside
    8.545e-04); CSV and JSON keep every digit."""
    import re

    assert main(["tasks", "--estimator", "elu", "--steps", "2", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    row = next(line for line in lines if line.startswith("mqar") and " elu " in line).split()
    cell = dict(zip(header, row, strict=True))
    assert re.fullmatch(r"[01]\.\d{3}", cell["accuracy"]), cell
    assert re.fullmatch(r"[+-]\d\.\d{3}", cell["vs_floor"]), cell
    assert re.fullmatch(r"\d+\.\d", cell["time_per_step_ms"]), cell
    assert re.fullmatch(r"\d+\.\d{2}", cell["time_vs_exact"]), cell
    assert re.fullmatch(r"\d+\.\d", cell["peak_mem_mb"]), cell


def test_seeds_summary_prints_accuracy_percent_with_one_decimal_and_ratios_with_two() -> None:
    from kernelattn_core.report.output import table
    from kernelattn_core.tasks.run import seeds_columns, seeds_formats

    records = [
        {"task": "mqar", "estimator": "exact", "budget": None, "accuracy": 0.98765, "time_vs_exact": 1.0},
        {"task": "mqar", "estimator": "prf", "budget": 64, "accuracy": 0.0001831, "time_vs_exact": 1.29712},
    ]
    columns = seeds_columns(records)
    lines = table(seeds_table(records), columns, seeds_formats(columns)).splitlines()
    assert lines[2].split() == ["exact", "-", "98.8", "98.8", "1.00", "1.00"]
    assert lines[3].split() == ["prf", "64", "0.0", "0.0", "1.30", "1.30"]
