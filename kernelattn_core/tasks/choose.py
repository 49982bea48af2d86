"""Which estimator for which need: picks by stated rules from measured results.

The package measures estimators in separate ways: what a small model learns with each
(:func:`~kernelattn_core.tasks.run.run_tasks`, ``kernelattn tasks``), how close each is to
the real attention of all-MiniLM-L6-v2 unfitted (``kernelattn compare --workload minilm``),
what more features buy (``kernelattn tasks --preset zoology``) and how close a fitted
conversion gets (``kernelattn convert --format json``). :func:`choose` reads their results
and returns three tables, each a header and rows of text:

* ``picks``: one row per need of :data:`NEEDS` (recall from scratch, whole-sequence
  classification, replacing a pretrained model's attention, approximating real attention
  unfitted, what to avoid for recall): the rule, the estimators it picks and the figures it
  picked them by. A rule picks nothing from runs that did not beat the floor, and says
  "not measured" when its results are missing;
* ``estimators``: one row per estimator spec measured, with what the registry declares it
  can do (its features, causal, decoding step, linear cost), its task accuracies, its
  training step against exact attention's and its MiniLM error;
* ``budgets``: MQAR accuracy per budget beside the MiniLM error per budget and the top-k
  oracle.

``kernelattn choose`` is the command line; ``docs/choosing.rst`` shows the tables of the
shipped measurements (written by ``docs/choosing_table.py`` with these functions).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import mean
from typing import Any

from ..errors import InputError, UnknownNameError
from .model import NO_MIXING
from .run import EXACT, LEARNED_MARGIN, parse_spec

#: the tasks of the seeds preset, as the table shows them (the recall tasks first)
TASKS = ("mqar", "induction", "selective-copy", "listops")
RECALL = ("mqar", "induction")
#: the MiniLM budget the table shows (issue 28's budget per query)
MINILM_BUDGET = 128
#: one held-out ListOps accuracy (512 examples, one label each, near 0.4) carries a standard
#: error of about 2 points: estimators within it of the best are a tie
LISTOPS_TIE = 0.02
#: the references of the results: exact attention and the floor (tasks), the mean of V and
#: the top-k oracle (the MiniLM comparison)
MEAN_V = "baseline:mean-v"
REFERENCES = (EXACT, NO_MIXING, MEAN_V, "oracle:top-k")


def capabilities(spec: str) -> dict[str, Any]:
    """What the registry says about the estimator ``spec`` (a name, or ``NAME:key=value,...``
    as :func:`~kernelattn_core.tasks.run.parse_spec` reads it: the options can change it,
    e.g. ``sliding-window:feature_map=prf`` has random features, not learned ones)."""
    from ..api import create
    from ..interfaces.estimator import supports_step
    from ..registry import get_registry

    name, options = parse_spec(spec)
    est = create(name, **options)
    fm = getattr(est, "feature_map", None)
    if name == EXACT:
        features = "none (softmax)"
    elif fm is None:
        features = "sampled keys"
    else:
        how = "learned" if fm.learnable else ("random" if fm.random else "fixed")
        features = f"{how}, {'positive' if fm.positive else 'signed'}"
    return {
        "plugin": get_registry().plugin_of(name).name,
        "features": features,
        "causal": bool(est.supports_causal),
        "decodes": supports_step(est),
        "linear": bool(getattr(est, "linear", False)),
    }


def _measured(compare: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The comparison's records with an error measured, those of the tutorial's example
    plugin (``example-*``, not a package estimator) left out."""
    return [
        r
        for r in compare
        if not r.get("error") and r.get("attn_rel_error") is not None and not r["estimator"].startswith("example-")
    ]


def _check_inputs(tasks: list[dict], compare: list[dict]) -> None:
    """Refuse what the tables would misread: a comparison of another workload than MiniLM's,
    one without the budget the tables read (:data:`MINILM_BUDGET`), a tasks sweep with
    several budgets of one estimator on one task (the picks compare estimators at one
    budget; a sweep over budgets is ``zoology``)."""
    workloads = sorted({str(r["workload"]) for r in compare if r.get("workload") not in (None, "minilm")})
    if workloads:
        raise InputError(
            f"compare: expected a comparison on real MiniLM attention (kernelattn compare --workload minilm), "
            f"got records of the {', '.join(workloads)} workload"
        )
    budgets = sorted({r["budget"] for r in _measured(compare) if r.get("budget") is not None})
    if budgets and MINILM_BUDGET not in budgets:
        raise InputError(
            f"compare: expected MiniLM errors at budget {MINILM_BUDGET} (the budget the tables read), got "
            f"budgets {budgets}; run kernelattn compare --workload minilm --budgets {MINILM_BUDGET}"
        )
    seen: dict[tuple[str, str], set[Any]] = {}
    for r in tasks:
        seen.setdefault((r["task"], r["estimator"]), set()).add(r.get("budget"))
    several = sorted((k, sorted(v)) for k, v in seen.items() if len(v) > 1)
    if several:
        (task, spec), values = several[0]
        raise InputError(
            f"tasks: expected one budget per estimator and task (the picks compare estimators at one budget), got "
            f"{spec} on {task} at budgets {values}; a sweep over budgets is read by --zoology"
        )


def collect(tasks: list[dict], compare: list[dict]) -> dict[str, dict[str, Any]]:
    """One entry per estimator spec (``hedgehog:init=prf`` and ``hedgehog`` are two):
    capabilities, task accuracies, MiniLM errors."""
    _check_inputs(tasks, compare)
    rows: dict[str, dict[str, Any]] = {}

    def row(spec: str) -> dict[str, Any]:
        if spec not in rows:
            rows[spec] = {"name": spec, "tasks": {}, "time": {}, "minilm": {}, "beats": {}}
        return rows[spec]

    for r in tasks:
        if r.get("error") or r.get("accuracy") is None:
            continue
        entry = row(r["estimator"])
        entry["tasks"][r["task"]] = r["accuracy"]
        if r.get("time_vs_exact") is not None:
            entry["time"][r["task"]] = r["time_vs_exact"]
    for r in _measured(compare):
        if r["budget"] not in (None, MINILM_BUDGET):
            continue
        entry = row(r["estimator"])
        entry["minilm"][r["regime"]] = r["attn_rel_error"]
        if r.get("beats_mean_v") is not None:
            entry["beats"][r["regime"]] = bool(r["beats_mean_v"])
    for spec, entry in rows.items():
        if spec not in REFERENCES[1:]:
            try:
                entry.update(capabilities(spec))
            except UnknownNameError as err:  # results of an estimator whose plugin is not installed here
                why = "its capabilities decide the picks"
                raise InputError(f"estimator {spec!r} of the results is not installed here ({why}): {err}") from err
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _recall(entry: dict[str, Any]) -> float | None:
    accs = [entry["tasks"].get(t) for t in RECALL]
    return None if None in accs else mean(accs)  # type: ignore[arg-type]


def _minilm(entry: dict[str, Any]) -> float | None:
    return mean(entry["minilm"].values()) if entry["minilm"] else None


def estimators_table(rows: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """One row per estimator: what it can do, what a model learns with it, how close it is."""
    header = [
        "estimator",
        "plugin",
        "features",
        "causal",
        "decodes",
        "cost",
        *(f"{t} %" for t in TASKS),
        "step vs exact",
        f"MiniLM error ({MINILM_BUDGET})",
        "beats mean-v",
    ]
    out = []
    order = sorted(
        (e for e in rows.values() if e["name"] not in REFERENCES[1:]),
        key=lambda e: (e["name"] != EXACT, -(_recall(e) if _recall(e) is not None else -1), e["name"]),
    )
    floor = rows.get(NO_MIXING)
    mean_v = rows.get(MEAN_V)
    for e in [*order, *(x for x in (floor, mean_v) if x is not None)]:
        ref = e["name"] in REFERENCES[1:]
        name = e["name"]
        times = list(e["time"].values())
        layers = e["beats"]
        err = _minilm(e)
        out.append(
            [
                name,
                "-" if ref else e["plugin"],
                "-" if ref else e["features"],
                "-" if ref else ("yes" if e["causal"] else "no"),
                "-" if ref else ("yes" if e["decodes"] else "no"),
                "-" if ref else ("linear" if e["linear"] else "quadratic"),
                *(_pct(e["tasks"].get(t)) for t in TASKS),
                "-" if not times or e["name"] == EXACT else f"{mean(times):.2f}",
                "-" if err is None else f"{err:.3f}",
                f"{sum(layers.values())}/{len(layers)}" if layers else "-",
            ]
        )
    return header, out


def _linear(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in rows.values() if e["name"] not in REFERENCES and e.get("linear")]


Picker = Callable[[dict[str, dict[str, Any]], list[dict[str, Any]]], tuple[list[str], str]]


def _task(rows: dict[str, dict[str, Any]], name: str, task: str) -> float | None:
    return rows.get(name, {}).get("tasks", {}).get(task)


def pick_recall(rows: dict[str, dict[str, Any]], fitted: list[dict[str, Any]]) -> tuple[list[str], str]:
    """The first need of :data:`NEEDS`: the picks and the figures they were picked by."""
    measured = [e for e in _linear(rows) if _recall(e) is not None]
    if not measured:
        return [], "not measured (needs mqar and induction)"
    floor = _recall(rows[NO_MIXING]) if NO_MIXING in rows else None
    pool = sorted(
        (e for e in measured if floor is None or _recall(e) > floor + LEARNED_MARGIN),  # type: ignore[operator]
        key=lambda e: -_recall(e),  # type: ignore[operator]
    )
    if not pool:
        return [], f"none of {len(measured)} beats the floor ({_pct(floor)}) by {100 * LEARNED_MARGIN:.0f} points"
    best = pool[:3]
    shown = "; ".join(f"{e['name']} {_pct(e['tasks']['mqar'])} / {_pct(e['tasks']['induction'])}" for e in best)
    exact = [_pct(_task(rows, EXACT, t)) for t in RECALL]
    return [e["name"] for e in best], f"{shown} (exact {exact[0]} / {exact[1]})"


def pick_listops(rows: dict[str, dict[str, Any]], fitted: list[dict[str, Any]]) -> tuple[list[str], str]:
    """The second need of :data:`NEEDS` (a tie within one standard error is reported whole)."""
    pool = [e for e in _linear(rows) if e["tasks"].get("listops") is not None]
    if not pool:
        return [], "not measured (needs listops)"
    top = max(e["tasks"]["listops"] for e in pool)
    exact, floor = (_task(rows, n, "listops") for n in (EXACT, NO_MIXING))
    if floor is not None and top <= floor + LEARNED_MARGIN:
        return [], f"none of {len(pool)} beats the floor ({_pct(floor)}) by {100 * LEARNED_MARGIN:.0f} points"
    tied = sorted((e for e in pool if e["tasks"]["listops"] >= top - LISTOPS_TIE), key=lambda e: -e["tasks"]["listops"])
    return [e["name"] for e in tied], (
        f"{len(tied)} of {len(pool)} within {100 * LISTOPS_TIE:.0f} points of the best ({_pct(top)}); "
        f"exact {_pct(exact)}, floor {_pct(floor)}"
    )


def pick_fitted(rows: dict[str, dict[str, Any]], fitted: list[dict[str, Any]]) -> tuple[list[str], str]:
    """The third need of :data:`NEEDS`, from the conversion summaries ``fitted``."""
    if not fitted:
        return [], "no conversion measured"
    best = min(fitted, key=lambda r: r["max_output_rel_error"])
    split = f" (budget {best['allocation'][0]['budget']} split per layer)" if best.get("allocation") else ""
    heavy = (best.get("options") or {}).get("heavy_keys")
    split += f" ({heavy} heavy keys)" if heavy else ""
    shown = f"{best['estimator']}{split}, {best['file']}: output error at most {best['max_output_rel_error']:.3f}"
    if best.get("passage512_mean") is None:  # a report without the embedding evaluation
        return [best["estimator"]], f"{shown} (every layer, every evaluation text)"
    return [best["estimator"]], (
        f"{shown} (every layer, every evaluation text); on the worst text 512-token passages cosine "
        f"{best['passage512_mean']:.3f} (min {best['passage512_min']:.3f}), sentence NN@1 {best['nn_agreement']:.3f}"
    )


def pick_unfitted(rows: dict[str, dict[str, Any]], fitted: list[dict[str, Any]]) -> tuple[list[str], str]:
    """The fourth need of :data:`NEEDS`, from the MiniLM comparison."""
    pool = [e for e in _linear(rows) if e["beats"] and all(e["beats"].values())]
    mean_v = _minilm(rows[MEAN_V]) if MEAN_V in rows else None
    if mean_v is None:
        return [], "not measured (needs the MiniLM comparison)"
    pool.sort(key=lambda e: _minilm(e))  # type: ignore[arg-type, return-value]
    best = pool[:3]
    shown = "; ".join(f"{e['name']} {_minilm(e):.3f}" for e in best) or "none beats it on every layer"
    return [e["name"] for e in best], f"{shown}; the mean of V {mean_v:.3f}"


def pick_fail_recall(rows: dict[str, dict[str, Any]], fitted: list[dict[str, Any]]) -> tuple[list[str], str]:
    """The fifth need of :data:`NEEDS`: the linear estimators at the floor on two recall tasks."""
    floor = rows.get(NO_MIXING, {}).get("tasks", {})
    if not all(t in floor for t in ("mqar", "selective-copy")):
        return [], "not measured (needs mqar and selective-copy)"

    def at_floor(e: dict[str, Any], task: str) -> bool:
        return e["tasks"].get(task) is not None and e["tasks"][task] <= floor[task] + LEARNED_MARGIN

    pool = [e for e in _linear(rows) if at_floor(e, "mqar") and at_floor(e, "selective-copy")]
    shown = "; ".join(f"{e['name']} {_pct(e['tasks']['mqar'])} / {_pct(e['tasks']['selective-copy'])}" for e in pool)
    return sorted(e["name"] for e in pool), f"{shown} (floor {_pct(floor['mqar'])} / {_pct(floor['selective-copy'])})"


#: (need, rule, picker): the rows of ``picks.csv``
NEEDS: tuple[tuple[str, str, Picker], ...] = (
    (
        "train from scratch: recall (associative recall, induction)",
        f"linear estimators with the highest mean accuracy on mqar and induction, more than "
        f"{100 * LEARNED_MARGIN:.0f} points above the floor (top 3; mqar / induction %)",
        pick_recall,
    ),
    (
        "train from scratch: classify whole sequences (ListOps)",
        f"linear estimators within {100 * LISTOPS_TIE:.0f} points (one standard error) of the best ListOps accuracy, "
        "if the best beats the floor",
        pick_listops,
    ),
    (
        "replace the attention of a pretrained softmax model",
        "the kernelattn convert report given with the lowest worst-layer output error",
        pick_fitted,
    ),
    (
        "approximate real attention without fitting",
        f"linear estimators that beat the mean of V on every MiniLM layer, lowest mean output error at budget "
        f"{MINILM_BUDGET} (top 3)",
        pick_unfitted,
    ),
    (
        "avoid for recall",
        f"linear estimators within {100 * LEARNED_MARGIN:.0f} points of the floor on mqar and selective-copy (%)",
        pick_fail_recall,
    ),
)


def picks_table(rows: dict[str, dict[str, Any]], fitted: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """One row per need of :data:`NEEDS`: the rule, what it picks, the figures it picked by."""
    out = []
    for need, rule, picker in NEEDS:
        chosen, figures = picker(rows, fitted)
        out.append([need, rule, ", ".join(chosen) or "none", figures])
    return ["need", "rule", "picks", "figures"], out


def figure(tasks: Sequence[dict[str, Any]], compare: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """What a model learns against how close the estimator is to real attention: for every
    estimator measured both ways (the same spec in the tasks and on MiniLM), its mean
    accuracy on the recall tasks (y) against its mean MiniLM output error unfitted (x, log
    scale), positive maps in one colour, signed ones in another; exact attention's
    accuracy (black dashes), the floor's (grey dots) and the mean of V's error (grey
    dashes) as lines. Needs matplotlib (``pip install 'kernelattn-core[plot]'``); raises
    :class:`~kernelattn_core.errors.InputError` when no estimator was measured both ways."""
    from ..report.plot import check_plot_path, pyplot, save

    check_plot_path(path)
    rows = collect(list(tasks), list(compare))

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    colours = {"positive": "tab:blue", "signed": "tab:red"}
    drawn: set[str] = set()
    placed: list[tuple[float, float]] = []
    points = [(e, _minilm(e), _recall(e)) for e in _linear(rows)]
    for e, x, y in sorted((p for p in points if p[1] is not None and p[2] is not None), key=lambda p: -p[2]):
        sign = e["features"].rsplit(", ", 1)[-1]
        colour = colours.get(sign, "tab:grey")
        ax.scatter(x, 100 * y, color=colour, s=30, zorder=3, label=None if sign in drawn else f"{sign} features")
        drawn.add(sign)
        # a label next to one already placed goes to the other side of its point
        near = any(abs(math.log10(x / px)) < 0.06 and abs(100 * y - py) < 5 for px, py in placed)
        where = dict(xytext=(-5, -11), ha="right") if near else dict(xytext=(5, 4), ha="left")
        ax.annotate(e["name"], (x, 100 * y), textcoords="offset points", fontsize=8, **where)  # type: ignore[arg-type]
        placed.append((x, 100 * y))
    if not placed:
        plt.close(fig)
        raise InputError("no linear estimator was measured both on the tasks and on MiniLM")
    if placed:
        xs = [px for px, _ in placed]
        ax.set_xlim(0.6 * min(xs), 2.5 * max(xs))  # room for the labels at either end
    for name, style in ((EXACT, dict(color="black", ls="--")), (NO_MIXING, dict(color="0.45", ls=":"))):
        y = _recall(rows[name]) if name in rows else None
        if y is not None:
            ax.axhline(100 * y, lw=1.2, label=f"{name} (accuracy)", **style)  # type: ignore[arg-type]
    mean_v = _minilm(rows[MEAN_V]) if MEAN_V in rows else None
    if mean_v is not None:
        ax.axvline(mean_v, color="0.45", ls="--", lw=1.2, label="mean of V (error)")
    ax.set(
        xscale="log",
        xlabel=f"MiniLM attention-output error, unfitted (budget {MINILM_BUDGET}, mean over layers)",
        ylabel="recall accuracy, mean of mqar and induction (%)",
        ylim=(-3, 103),
        title="learning a task vs approximating real attention",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    return save(fig, path)


def budgets_table(zoology: list[dict], compare: list[dict]) -> tuple[list[str], list[list[str]]]:
    """What more features buy: the accuracy on each task of a tasks sweep over budgets (the
    zoology preset: MQAR; mean and standard deviation over its seeds) at each budget, and
    the unfitted MiniLM error at each budget of the comparison (mean over layers), one row
    per estimator spec with a budget; the top-k oracle (softmax over each query's ``k``
    largest logits, quadratic) last, as what a sparse budget of that size could reach."""
    swept = [r for r in zoology if r.get("budget") is not None and not r.get("error") and r.get("accuracy") is not None]
    columns = sorted({(r["task"], r["budget"]) for r in swept}, key=lambda c: (c[0] != "mqar", c))
    minilm = sorted({r["budget"] for r in compare if r.get("budget") is not None and not r.get("error")})
    acc: dict[str, dict[tuple[str, int], str]] = {}
    err: dict[str, dict[int, list[float]]] = {}
    for r in swept:
        std = f" ± {100 * r['accuracy_std']:.1f}" if r.get("accuracy_std") is not None else ""
        acc.setdefault(r["estimator"], {})[(r["task"], r["budget"])] = f"{100 * r['accuracy']:.1f}{std}"
    for r in _measured(compare):
        if r["budget"] is not None:
            err.setdefault(r["estimator"], {}).setdefault(r["budget"], []).append(r["attn_rel_error"])
    names = sorted(set(acc) | set(err), key=lambda n: (n.startswith("oracle:"), n not in acc, n))
    header = ["estimator", *(f"{t} % at {b}" for t, b in columns), *(f"MiniLM error at {b}" for b in minilm)]
    out = []
    for n in names:
        errors = [err.get(n, {}).get(b) for b in minilm]
        cells = [acc.get(n, {}).get(c, "-") for c in columns]
        out.append([n, *cells, *("-" if e is None else f"{mean(e):.3f}" for e in errors)])
    return header, out


def conversion_summary(records: Sequence[dict[str, Any]], file: str = "", name: str = "conversion") -> dict[str, Any]:
    """The summary record of a ``kernelattn convert --format json`` report (``records``),
    with ``file`` (where it came from) added; :class:`InputError` naming ``name`` when
    there is none."""
    for r in records:
        if isinstance(r, dict) and r.get("summary") and "max_output_rel_error" in r:
            return {**r, "file": file}
    raise InputError(
        f"{name}: expected a kernelattn convert json report (with its summary record), got none in {file!r}"
    )


#: the fields that identify the records of each kind of result (:func:`read_results`)
FIELDS = {
    "tasks": ("task", "estimator", "accuracy"),
    "compare": ("estimator", "regime", "budget", "attn_rel_error"),
    "convert": ("summary",),
}


def read_results(path: str | Path, name: str, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of a results file (the JSON list that ``kernelattn tasks``, ``compare`` and
    ``convert`` write with ``--format json``); with ``kind`` (a key of :data:`FIELDS`) the
    records must be of that kind. Errors name the argument ``name``."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{name}: expected a results file (json), got {str(path)!r}, which is not a file")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{name}: expected a JSON list of records in {str(path)!r}: {err}") from err
    if isinstance(data, dict) and isinstance(data.get("records"), list):  # {"meta": ..., "records": [...]}
        data = data["records"]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise InputError(f"{name}: expected a JSON list of records in {str(path)!r}, got {type(data).__name__}")
    if kind is not None and not any(all(f in r for f in FIELDS[kind]) for r in data):
        seen = sorted({f for r in data[:5] for f in r})[:8]
        raise InputError(
            f"{name}: expected the records of kernelattn {kind} (fields {', '.join(FIELDS[kind])}) in "
            f"{str(path)!r}, got {len(data)} record(s) with fields {seen}"
        )
    return data


def choose(
    tasks: Sequence[dict[str, Any]] = (),
    compare: Sequence[dict[str, Any]] = (),
    zoology: Sequence[dict[str, Any]] = (),
    conversions: Sequence[dict[str, Any]] = (),
) -> dict[str, tuple[list[str], list[list[str]]]]:
    """The three tables (``"picks"``, ``"estimators"``, ``"budgets"``) from the records of a
    tasks sweep at one budget (``tasks``), a MiniLM comparison (``compare``), a tasks sweep
    over budgets (``zoology``) and conversion summaries (:func:`conversion_summary`). Any
    of them may be empty: the columns and picks that need it stay empty."""
    rows = collect(list(tasks), list(compare))
    return {
        "picks": picks_table(rows, list(conversions)),
        "estimators": estimators_table(rows),
        "budgets": budgets_table(list(zoology), list(compare)),
    }


__all__ = [
    "FIELDS",
    "LISTOPS_TIE",
    "MEAN_V",
    "MINILM_BUDGET",
    "NEEDS",
    "budgets_table",
    "capabilities",
    "choose",
    "collect",
    "conversion_summary",
    "estimators_table",
    "figure",
    "picks_table",
    "read_results",
]
