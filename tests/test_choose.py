"""Which estimator for which need (:mod:`kernelattn_core.tasks.choose`, ``kernelattn choose``)
and docs/choosing.rst, whose tables ``docs/choosing_table.py`` writes with it.

The shipped tables are regenerated from the shipped files (a table edited by hand, or data
re-measured without the tables, fails); each pick moves when the figure it rests on moves
(a rule that ignored its data would not); the command refuses files of the wrong kind.
"""

from __future__ import annotations

import copy
import csv
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from kernelattn_core.cli.main import main as cli
from kernelattn_core.tasks import choose

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "docs" / "_static"

_spec = importlib.util.spec_from_file_location("choosing_table", ROOT / "docs" / "choosing_table.py")
assert _spec is not None and _spec.loader is not None
choosing = importlib.util.module_from_spec(_spec)
sys.modules["choosing_table"] = choosing
_spec.loader.exec_module(choosing)


def _csv(path: Path) -> tuple[list[str], list[list[str]]]:
    with path.open(newline="", encoding="utf-8") as f:
        header, *rows = list(csv.reader(f))
    return header, rows


@pytest.fixture(scope="module")
def data() -> dict:
    return {
        "seeds": json.loads((STATIC / "tasks" / "seeds.json").read_text(encoding="utf-8")),
        "compare": json.loads((STATIC / "choosing" / "minilm_compare.json").read_text(encoding="utf-8")),
        "fitted": choosing.conversions(STATIC),
    }


def _picks(seeds: list[dict], compare: list[dict], fitted: list[dict]) -> dict[str, list[str]]:
    rows = choose.collect(seeds, compare)
    _, table = choose.picks_table(rows, fitted)
    return {need: picks.split(", ") for need, _, picks, _ in table}


def _need(word: str) -> str:
    (need,) = [n for n, _, _ in choose.NEEDS if word in n]
    return need


def test_the_shipped_tables_follow_from_the_shipped_files() -> None:
    tables = choosing.tables(STATIC)
    assert set(tables) == {"picks.csv", "estimators.csv", "budgets.csv"}
    for name, (header, rows) in tables.items():
        again = "run python docs/choosing_table.py docs/_static"
        assert _csv(STATIC / "choosing" / name) == (header, rows), f"{name} is stale: {again}"


def test_the_page_includes_both_tables() -> None:
    page = (ROOT / "docs" / "choosing.rst").read_text(encoding="utf-8")
    for name in ("picks.csv", "estimators.csv", "budgets.csv"):
        assert f":file: _static/choosing/{name}" in page


def test_every_measured_estimator_has_a_row_and_the_references_come_last(data: dict) -> None:
    _, rows = choose.estimators_table(choose.collect(data["seeds"], data["compare"]))
    names = [r[0] for r in rows]
    measured = {r["estimator"] for r in data["seeds"]} | {
        r["estimator"] for r in data["compare"] if not r["estimator"].startswith(("example-", "oracle:"))
    }
    assert set(names) == measured
    assert names[0] == "exact" and names[-2:] == ["baseline:no-mixing", "baseline:mean-v"]
    by_name = {r[0]: r for r in rows}
    assert by_name["lara"][3] == "no" and by_name["prf"][3] == "yes"  # causal
    assert by_name["exact"][4] == "no" and by_name["prf"][4] == "yes"  # decodes
    assert by_name["ra"][5] == "quadratic" and by_name["prf"][5] == "linear"
    assert by_name["rfa"][2].endswith("signed") and by_name["prf"][2] == "random, positive"


def test_the_recall_pick_follows_the_accuracies(data: dict) -> None:
    need = _need("from scratch: recall")
    before = _picks(data["seeds"], data["compare"], data["fitted"])[need]
    assert "prf" not in before  # the shipped data: prf is not among the three best at recall
    seeds = copy.deepcopy(data["seeds"])
    for r in seeds:
        if r["estimator"] == "prf" and r["task"] in choose.RECALL:
            r["accuracy"] = 0.999
    after = _picks(seeds, data["compare"], data["fitted"])[need]
    assert after[0] == "prf" and after[1:] == before[:2]


def test_a_quadratic_estimator_is_never_picked_for_recall(data: dict) -> None:
    seeds = copy.deepcopy(data["seeds"])
    for r in seeds:
        if r["estimator"] == "ra" and r["task"] in choose.RECALL:
            r["accuracy"] = 1.0  # better than every linear one: still not a pick (its cost)
    assert "ra" not in _picks(seeds, data["compare"], data["fitted"])[_need("from scratch: recall")]


def test_the_listops_pick_is_the_set_within_one_standard_error(data: dict) -> None:
    need = _need("ListOps")
    picked = _picks(data["seeds"], data["compare"], data["fitted"])[need]
    listops = {r["estimator"]: r["accuracy"] for r in data["seeds"] if r["task"] == "listops" and not r.get("error")}
    top = max(listops[n] for n in picked)
    assert all(listops[n] >= top - choose.LISTOPS_TIE for n in picked)
    left_out = [n for n in listops if n not in picked and n not in choose.REFERENCES and n != "ra"]
    assert left_out and all(listops[n] < top - choose.LISTOPS_TIE for n in left_out)
    seeds = copy.deepcopy(data["seeds"])
    for r in seeds:
        if r["estimator"] == picked[0] and r["task"] == "listops":
            r["accuracy"] = top + 0.1  # far ahead: the tie collapses to one
    assert _picks(seeds, data["compare"], data["fitted"])[need] == [picked[0]]


def test_the_avoid_pick_follows_the_floor(data: dict) -> None:
    need = _need("avoid")
    before = _picks(data["seeds"], data["compare"], data["fitted"])[need]
    assert "rmfa" in before and "generative-prf" not in before
    seeds = copy.deepcopy(data["seeds"])
    for r in seeds:
        if r["estimator"] == "rmfa" and r["task"] == "mqar":
            r["accuracy"] = 0.5  # learned it
        if r["estimator"] == "generative-prf" and r["task"] in ("mqar", "selective-copy"):
            r["accuracy"] = 0.0  # at the floor
    after = _picks(seeds, data["compare"], data["fitted"])[need]
    assert "rmfa" not in after and "generative-prf" in after


def test_the_unfitted_pick_needs_every_layer_beaten(data: dict) -> None:
    need = _need("without fitting")
    before = _picks(data["seeds"], data["compare"], data["fitted"])[need]
    assert before and "sliding-window" not in before  # lowest mean error, but beats mean-v on 3 of 6 layers
    compare = copy.deepcopy(data["compare"])
    for r in compare:
        if r["estimator"] == "sliding-window":
            r["beats_mean_v"] = True
    assert _picks(data["seeds"], compare, data["fitted"])[need][0] == "sliding-window"


def test_the_fitted_pick_is_the_lowest_worst_layer(data: dict, tmp_path: Path) -> None:
    need = _need("pretrained")
    fitted = data["fitted"]
    assert {r["fit_texts"] for r in fitted} == {"fitting"} and len(fitted) >= 2
    assert _picks(data["seeds"], data["compare"], fitted)[need] == ["sliding-window"]
    rows = choose.collect(data["seeds"], data["compare"])
    _, figures = choose.pick_fitted(rows, fitted)
    best = min(r["max_output_rel_error"] for r in fitted)
    assert f"at most {best:.3f}" in figures
    winner = min(fitted, key=lambda r: r["max_output_rel_error"])
    heavy = winner["options"].get("heavy_keys")
    assert (f"({heavy} heavy keys)" in figures) == bool(heavy)  # the recipe is named, not only the estimator
    # a conversion fitted on another corpus is not a candidate, however good
    static = tmp_path / "_static"
    shutil.copytree(STATIC / "convert", static / "convert")
    other = json.loads((static / "convert" / "minilm_fit_legal.json").read_text(encoding="utf-8"))
    for r in other:
        if r.get("summary"):
            r["max_output_rel_error"] = 0.01
    (static / "convert" / "minilm_fit_legal.json").write_text(json.dumps(other), encoding="utf-8")
    assert [r["file"] for r in choosing.conversions(static)] == [r["file"] for r in fitted]
    assert choose.pick_fitted(rows, [])[0] == []


def test_a_folder_of_your_own_with_part_of_the_measurements(data: dict, tmp_path: Path) -> None:
    """The page tells readers to point the script at their own sweep: one with the recall
    tasks only and no MiniLM comparison or conversion gives the picks it can and says
    which it cannot; a folder with none of the files is refused."""
    (tmp_path / "tasks").mkdir()
    mine = [r for r in data["seeds"] if r["task"] in choose.RECALL]
    (tmp_path / "tasks" / "seeds.json").write_text(json.dumps(mine), encoding="utf-8")
    assert choosing.main([str(tmp_path)]) == 0
    _, picks = _csv(tmp_path / "choosing" / "picks.csv")
    by_need = {row[0]: row for row in picks}
    recall = by_need[_need("from scratch: recall")]
    assert recall[2] == "generative-prf, hedgehog:init=prf, fastfood-prf"  # as from the whole file
    for word, why in (("ListOps", "needs listops"), ("without fitting", "MiniLM"), ("avoid", "selective-copy")):
        assert (
            by_need[_need(word)][2] == "none"
            and "not measured" in by_need[_need(word)][3]
            and why in by_need[_need(word)][3]
        )
    assert by_need[_need("pretrained")][3] == "no conversion measured"
    _, rows = _csv(tmp_path / "choosing" / "estimators.csv")
    assert {r[0] for r in rows} == {r["estimator"] for r in mine if not r.get("error")}  # lara: non-causal only
    assert all(r[-2:] == ["-", "-"] for r in rows)  # no MiniLM columns
    assert choosing.main([str(tmp_path / "empty")]) == 2


def test_the_figure_draws_every_estimator_measured_both_ways(data: dict, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = choose.collect(data["seeds"], data["compare"])
    both = {
        e["name"]
        for e in rows.values()
        if e["name"] not in choose.REFERENCES and e["tasks"].get("mqar") is not None and e["minilm"]
    }
    both = {n for n in both if rows[n].get("linear") and choose._recall(rows[n]) is not None}
    assert {"generative-prf", "rfa", "schoenbat"} <= both and "hedgehog:init=prf" not in both
    svg = choose.figure(data["seeds"], data["compare"], tmp_path / "f.svg").read_text(encoding="utf-8")  # text stays
    for name in both:
        assert f">{name}<" in svg
    assert ">hedgehog<" not in svg and ">ra<" not in svg  # one side only; quadratic


def test_nothing_is_picked_from_runs_that_learned_nothing(data: dict) -> None:
    """A short sweep where no estimator beats the floor picks none for recall or ListOps
    (a pick of the least bad of the failed runs would be read as a recommendation)."""
    seeds = copy.deepcopy(data["seeds"])
    floor = {r["task"]: r["accuracy"] for r in seeds if r["estimator"] == "baseline:no-mixing"}
    for r in seeds:
        if r["estimator"] not in choose.REFERENCES and not r.get("error"):
            r["accuracy"] = floor[r["task"]] + 0.01
    picks = choose.picks_table(choose.collect(seeds, data["compare"]), data["fitted"])[1]
    by_need = {row[0]: row for row in picks}
    for word in ("from scratch: recall", "ListOps"):
        assert by_need[_need(word)][2] == "none" and "beats the floor" in by_need[_need(word)][3]


def test_the_budget_table_holds_each_budget_of_both_files(data: dict) -> None:
    zoology = json.loads((STATIC / "tasks" / "zoology.json").read_text(encoding="utf-8"))
    header, rows = choose.budgets_table(zoology, data["compare"])
    assert header[1:] == ["mqar % at 16", "mqar % at 64", "mqar % at 256", "MiniLM error at 64", "MiniLM error at 128"]
    by_name = {r[0]: r for r in rows}
    prf = {r["budget"]: r for r in zoology if r["estimator"] == "prf"}
    assert by_name["prf"][1:4] == [
        f"{100 * prf[b]['accuracy']:.1f} ± {100 * prf[b]['accuracy_std']:.1f}" for b in (16, 64, 256)
    ]
    errors = [r["attn_rel_error"] for r in data["compare"] if r["estimator"] == "prf" and r["budget"] == 128]
    assert len(errors) == 6 and by_name["prf"][5] == f"{sum(errors) / 6:.3f}"  # mean over the six layers
    assert rows[-1][0] == "oracle:top-k" and "exact" not in by_name and "elu" not in by_name  # no budget
    assert by_name["hedgehog:init=prf"][4:] == ["-", "-"]  # trained, not compared on MiniLM


def test_the_command_prints_the_picks_of_the_files_given(capsys: pytest.CaptureFixture[str]) -> None:
    tasks, compare = STATIC / "tasks" / "seeds.json", STATIC / "choosing" / "minilm_compare.json"
    conversion = STATIC / "convert" / "minilm_sliding_window.json"
    assert cli(["choose", "--tasks", str(tasks), "--compare", str(compare), "--conversion", str(conversion)]) == 0
    out = capsys.readouterr().out
    _, picks = _csv(STATIC / "choosing" / "picks.csv")
    for need, _rule, chosen, _figures in picks:
        assert f"{need}:\n  picks    {chosen}\n" in out  # the docs' picks (the same data and rules)
    assert "minilm_sliding_window.json: output error at most 0.299" in out  # the one conversion given


def test_the_command_writes_any_table_as_csv_or_json(tmp_path: Path) -> None:
    zoology = STATIC / "tasks" / "zoology.json"
    compare = STATIC / "choosing" / "minilm_compare.json"
    out = tmp_path / "budgets.csv"
    assert (
        cli(
            ["choose", "--zoology", str(zoology), "--compare", str(compare), "--table", "budgets", "--output", str(out)]
        )
        == 0
    )
    assert _csv(out) == _csv(STATIC / "choosing" / "budgets.csv")
    out = tmp_path / "estimators.json"
    assert (
        cli(["choose", "--tasks", str(STATIC / "tasks" / "seeds.json"), "--table", "estimators", "--output", str(out)])
        == 0
    )
    rows = json.loads(out.read_text(encoding="utf-8"))
    # typed as JSON reads them: numbers, booleans, null for a dash (not the table's strings)
    assert rows[0]["estimator"] == "exact" and rows[0]["mqar %"] == 100.0
    prf = next(r for r in rows if r["estimator"] == "prf")
    assert prf["causal"] is True and isinstance(prf["step vs exact"], float) and prf["step vs exact"] > 1
    assert {r["MiniLM error (128)"] for r in rows} == {None}  # no comparison given


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "expected at least one of --tasks"),
        (["--tasks", "no-such.json"], "--tasks: expected a results file"),
        (["--tasks", "README.md"], "--tasks: expected a JSON list of records"),
        (["--tasks", "docs/_static/choosing/minilm_compare.json"], "--tasks: expected the records of kernelattn tasks"),
        (["--compare", "docs/_static/tasks/seeds.json"], "--compare: expected the records of kernelattn compare"),
        (["--conversion", "docs/_static/tasks/seeds.json"], "--conversion: expected the records of kernelattn convert"),
        (["--tasks", "docs/_static/tasks/seeds.json", "--plot", "f.txt"], "--plot: expected a file ending in"),
    ],
)
def test_the_command_refuses_what_it_cannot_read(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    assert cli(["choose", *argv]) == 2
    assert message in capsys.readouterr().err


def test_what_the_tables_would_misread_is_refused(data: dict) -> None:
    """A synthetic comparison (its errors are not MiniLM's), a comparison without the budget
    the tables read, and a tasks file with several budgets of one estimator (the last would
    silently win) are refused, naming what came; the shipped files pass (negative control)."""
    choose.choose(data["seeds"], data["compare"])
    synthetic = [{**r, "workload": "synthetic"} for r in data["compare"]]
    with pytest.raises(choose.InputError, match="compare: expected a comparison on real MiniLM attention.*synthetic"):
        choose.choose(data["seeds"], synthetic)
    at_64 = [r for r in data["compare"] if r["budget"] in (None, 64)]
    assert at_64 and any(r["budget"] == 64 for r in at_64)
    with pytest.raises(choose.InputError, match=r"expected MiniLM errors at budget 128 .*got budgets \[64\]"):
        choose.choose(data["seeds"], at_64)
    with pytest.raises(choose.InputError, match=r"expected MiniLM errors at budget 128"):
        choose.figure(data["seeds"], at_64, "never.png")
    prf = next(r for r in data["seeds"] if r["estimator"] == "prf")
    twice = [*data["seeds"], {**prf, "budget": 256, "accuracy": 0.99}]
    with pytest.raises(
        choose.InputError, match=r"tasks: expected one budget per estimator.*prf on \w+ at budgets \[64, 256\]"
    ):
        choose.choose(twice)


def test_a_convert_report_without_its_summary_is_refused() -> None:
    layers = [
        r for r in json.loads((STATIC / "convert" / "minilm_sliding_window.json").read_text()) if not r.get("summary")
    ]
    with pytest.raises(choose.InputError, match="--conversion: expected a kernelattn convert json report"):
        choose.conversion_summary(layers, "x.json", "--conversion")


def test_capabilities_read_the_options_of_a_spec() -> None:
    """``sliding-window:feature_map=prf`` has random features, ``sliding-window:init=prf``
    learned ones: the options are built, not dropped."""
    assert choose.capabilities("sliding-window:feature_map=prf")["features"] == "random, positive"
    assert choose.capabilities("sliding-window:init=prf")["features"] == "learned, positive"
    assert choose.capabilities("lara")["causal"] is False and choose.capabilities("ra")["linear"] is False


def test_results_of_an_estimator_not_installed_here_are_refused_by_name(data: dict) -> None:
    tasks = [*data["seeds"], {**data["seeds"][2], "estimator": "no-such-plugin-map"}]
    with pytest.raises(choose.InputError, match="estimator 'no-such-plugin-map' of the results is not installed here"):
        choose.choose(tasks)


def test_every_registered_estimator_is_in_the_docs_table_or_named_as_missing() -> None:
    """docs/choosing.rst names the registered estimators that neither file measured; a new
    estimator (a plugin added to the package) fails this until it is measured or named."""
    import kernelattn_core as ka

    reg = ka.get_registry()
    registered = {e.name for kind in ("estimator", "feature_map") for e in reg.entries(kind)}
    registered -= {"feature-map", "example-antithetic"}  # the generic wrapper; the tutorial's example plugin
    _, rows = _csv(STATIC / "choosing" / "estimators.csv")
    shown = {r[0].split(":", 1)[0] for r in rows}
    missing = registered - shown
    assert missing == {"rfa-gate", "ra-biased"}
    page = (ROOT / "docs" / "choosing.rst").read_text(encoding="utf-8")
    assert all(
        f"``{name}``" in page.split("Two registered estimators are in neither file")[1][:200] for name in missing
    )


def test_a_conversion_without_the_embedding_evaluation_is_still_a_candidate(data: dict) -> None:
    bare = {k: v for k, v in data["fitted"][0].items() if not k.startswith(("passage", "nn_"))}
    picks, figures = choose.pick_fitted({}, [bare])
    assert picks == ["sliding-window"] and figures.endswith("(every layer, every evaluation text)")


def test_a_budget_sweep_of_another_task_gets_its_own_columns(data: dict) -> None:
    zoology = json.loads((STATIC / "tasks" / "zoology.json").read_text(encoding="utf-8"))
    other = [{**r, "task": "induction", "accuracy": 0.5} for r in zoology if r["estimator"] == "prf"]
    header, rows = choose.budgets_table(zoology + other, [])
    assert header[1:4] == ["mqar % at 16", "mqar % at 64", "mqar % at 256"]
    assert header[4:] == ["induction % at 16", "induction % at 64", "induction % at 256"]
    prf = {r[0]: r for r in rows}["prf"]
    assert all(cell.startswith("50.0 ± ") for cell in prf[4:7]) and not prf[1].startswith("50.0")  # not mixed
