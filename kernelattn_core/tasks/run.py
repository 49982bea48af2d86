"""``run_tasks``: train every chosen estimator on every chosen task and summarise what it learned.

For each task the two references run first, ``exact`` (softmax attention: the ceiling) and
``baseline:no-mixing`` (the floor: the same model without attention); then every
estimator at every budget, over the seeds. One record per (task, estimator, budget), in
the order they finish, with:

* ``accuracy`` / ``accuracy_std``: mean and standard deviation over seeds of the held-out
  accuracy (``accuracies`` lists them);
* ``vs_floor``: accuracy minus the floor's; ``learned``: whether it beats the floor by more
  than :data:`LEARNED_MARGIN` (``"no"`` marks an estimator with which the model did not learn
  the task at all);
* ``steps_to_90``: the median over seeds of the first evaluation step at which the accuracy
  reached 90 % of the ceiling's (``None`` if it never did, or if the ceiling did not beat
  the floor by :data:`LEARNED_MARGIN`);
* ``time_per_step_ms`` (median step, mean over seeds), ``time_vs_exact``, ``peak_mem_mb``
  (peak tensor memory of one training step), ``train_s`` (wall time of one run) and
  ``first_step_s`` (the first step: the compilation with ``compile=True``);
* ``device`` and ``compiled``: where and how the runs trained;
* ``error``: why the row has no result (an estimator that cannot attend the way the task
  needs, or the exception a run raised).

Budgets: the budget is what each query pays beyond its own key: the feature dimension
(the width of the causal state) for feature maps, so ``num_features`` for most of them and
half of it for the maps whose ``num_features`` counts frequencies each giving a cosine and
a sine feature (``rfa``, ``gmm-rks``); samples for ``lara``. ``sliding-window`` splits
it between its exact window and its feature map (:func:`budget_options`), so that it is
compared at the same total.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import InputError, KernelAttnError
from ..registry import get_registry
from ..validation import check_device, check_positive_int
from . import get_task
from .base import Task
from .journal import RunJournal, run_key
from .model import NO_MIXING
from .train import TrainConfig, build_model, compile_backend, steps_to_fraction, train

#: an estimator "learned" a task when its accuracy beats the floor's by more than this
LEARNED_MARGIN = 0.05
#: the fraction of the ceiling's accuracy that ``steps_to_90`` waits for
CEILING_FRACTION = 0.9
EXACT = "exact"
DEFAULT_BUDGETS = (64,)

#: the training recipe of each task at each scale (identical for every estimator of a task)
RECIPES: dict[tuple[str, str], TrainConfig] = {
    # chosen with exact attention: MQAR is solved (1.00) by step 200 of 500; induction jumps to
    # 1.00 near step 400 when the rate stays high long enough (500 steps of decay: 0.17);
    # ListOps keeps improving slowly (0.39 at 800 steps). Selective copy was trimmed from
    # 800 to 480 steps for the preset's time (its rows keep their order from step 400 on;
    # exact 0.44 at 480 against 0.49 at 800). Tried and rejected (2026-11-25): MQAR at 300
    # steps (the shorter schedule loses 10-60 points: ra 1.00 -> 0.36, fastfood-prf 0.90 ->
    # 0.68), induction at 640 (hedgehog:init=prf 0.50 -> 0.20: the linear estimators learn
    # it late), batches of 16 (exact attention no longer learns induction: 0.02)
    ("mqar", "quick"): TrainConfig(steps=500, batch_size=32, lr=3e-3, eval_every=50),
    ("listops", "quick"): TrainConfig(steps=800, batch_size=32, lr=1e-3, eval_every=80),
    ("selective-copy", "quick"): TrainConfig(steps=480, batch_size=32, lr=3e-3, eval_every=48),
    ("induction", "quick"): TrainConfig(steps=800, batch_size=32, lr=3e-3, eval_every=80),
    ("mqar", "paper"): TrainConfig(steps=20_000, batch_size=64, lr=1e-3, d_model=128, eval_every=500),
    ("listops", "paper"): TrainConfig(steps=10_000, batch_size=32, lr=1e-4, d_model=64, eval_every=500),
    ("selective-copy", "paper"): TrainConfig(steps=20_000, batch_size=32, lr=1e-3, d_model=128, eval_every=500),
    ("induction", "paper"): TrainConfig(steps=20_000, batch_size=32, lr=1e-3, d_model=128, eval_every=500),
}

#: table columns (CSV and JSON carry every field)
COLUMNS = (
    "task",
    "estimator",
    "budget",
    "accuracy",
    "accuracy_std",
    "vs_floor",
    "learned",
    "steps_to_90",
    "time_per_step_ms",
    "time_vs_exact",
    "peak_mem_mb",
    "error",
)
CSV_COLUMNS = (
    *COLUMNS[:-1],
    "accuracies",
    "chance",
    "ceiling",
    "floor",
    "first_loss",
    "last_loss",
    "train_s",
    "first_step_s",
    "params",
    "seeds",
    "steps",
    "scale",
    "device",
    "compiled",
    "options",
    "error",
)
WIDTHS = {"task": 14, "estimator": 20, "accuracy": 8, "error": 10}
#: how the table prints each float column (CSV and JSON keep every digit)
CELL_FORMATS = {
    "accuracy": ".3f",
    "accuracy_std": ".3f",
    "vs_floor": "+.3f",
    "time_per_step_ms": ".1f",
    "time_vs_exact": ".2f",
    "peak_mem_mb": ".1f",
}


@dataclass(frozen=True)
class Preset:
    """A named selection for ``kernelattn tasks --preset NAME``."""

    name: str
    help: str
    tasks: tuple[str, ...]
    estimators: tuple[str, ...]
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    seeds: tuple[int, ...] = (0,)
    extra: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "seeds": Preset(
        "seeds",
        "the estimators of the five source papers (+ hedgehog, sliding-window) on every task, as their Table 2",
        tasks=("listops", "mqar", "selective-copy", "induction"),
        estimators=(
            EXACT,
            "prf",  # Performer (the KL-Transformer's, LARA's and SchoenbAt's baseline)
            "rfa",  # RFA (SchoenbAt's and Macformer's baseline)
            "rmfa",  # Macformer / SchoenbAt without ppSBN
            "schoenbat",  # SchoenbAt (= Macformer): RMFA with ppSBN
            "gmm-rks",  # KL-Transformer, an RKS variant (its PRF-against-RKS ordering)
            "gmm-prf",  # KL-Transformer, the PRF variants
            "fastfood-prf",
            "generative-prf",
            "ra",  # randomized attention (quadratic, one sample)
            "lara",  # linear randomized attention (non-causal only: ListOps)
            "cexp",  # complex-exponential features
            "hedgehog:init=prf",  # learned map, trainable from scratch (its default init is for distillation)
            "sliding-window:init=prf",  # exact window + hedgehog features at the same total budget
        ),
        budgets=(64,),
    ),
    "zoology": Preset(
        "zoology",
        "MQAR accuracy against the budget 16-256 (Zoology's Fig. 2 at CPU scale), two seeds",
        tasks=("mqar",),
        estimators=(
            EXACT,
            "prf",
            "hedgehog",
            "hedgehog:init=prf",
            "elu",
            "sliding-window:init=prf",
            "sliding-window:feature_map=prf",
        ),
        budgets=(16, 64, 256),
        seeds=(0, 1),
    ),
}


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"NAME"`` or ``"NAME:key=value,key=value"`` as the registry name and its options.

    Values are Python literals where they parse as one (``init=prf`` is the string
    ``"prf"``, ``window=8`` the int 8, ``tied=True`` the bool), so one estimator can run in
    several configurations in one table (``hedgehog`` and ``hedgehog:init=prf``).
    """
    import ast

    if not isinstance(spec, str) or not spec.strip():
        raise InputError(f"estimator: expected NAME or NAME:key=value,..., got {spec!r}")
    if spec == NO_MIXING:  # the floor's name has a colon of its own
        return spec, {}
    name, _, rest = spec.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or not key.strip() or not key.strip().isidentifier():
            raise InputError(f"estimator: expected key=value options after {name}:, got {item!r} in {spec!r}")
        try:
            value: Any = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            value = raw.strip()
        options[key.strip()] = value
    return name.strip(), options


def default_estimators(*, quadratic: bool = False) -> list[str]:
    """``exact``, then every registered estimator and feature map whose cost is linear in
    the sequence length (all of them with ``quadratic``); the generic ``feature-map``
    wrapper is left out (every map runs under its own name)."""
    reg = get_registry()
    names = [EXACT]
    for entry in reg.entries("estimator"):
        if entry.name in (EXACT, "feature-map"):
            continue
        if quadratic or getattr(entry.cls, "linear", True):
            names.append(entry.name)
    return names + list(reg.names("feature_map"))


def cannot_run(name: str, task: Task) -> str | None:
    """Why ``name`` (a registry name or spec) cannot attend the way ``task`` needs (``None`` when it can)."""
    name = parse_spec(name)[0]
    if name in (EXACT, NO_MIXING):
        return None
    cls = get_registry().get(name).cls
    if task.causal and not getattr(cls, "supports_causal", True):
        return f"non-causal only: {name} cannot attend causally, and {task.name} is autoregressive"
    if not task.causal and not getattr(cls, "supports_noncausal", True):
        return f"causal only: {name} cannot attend bidirectionally, and {task.name} is a classification"
    return None


#: the options :func:`budget_options` sets, where they are more than ``num_features``
_BUDGET_KEYS = {"sliding-window": {"window", "num_features"}}


def has_budget(name: str) -> bool:
    """Whether ``name`` (a registry name or spec) is swept over the budget.

    Estimators quadratic in the length (``linear = False``: ``ra``, ``ra-biased``) are not:
    their ``num_features`` is a number of samples per query, each a pass over every key,
    not a per-query state; they run at their own default (the paper's one sample), and a
    spec (``ra:num_features=4``) sets another. Nor is a spec that sets an option the budget
    sets (``num_features``; ``sliding-window``'s ``window`` too): ``prf:num_features=128``
    runs once, at its own size, with no budget in its row (a budget label on it would name a
    size it does not have)."""
    base, spec_options = parse_spec(name)
    if base in (EXACT, NO_MIXING):
        return False
    entry = get_registry().get(base)
    if not (getattr(entry.cls, "has_budget", False) and getattr(entry.cls, "linear", True)):
        return False
    return not spec_options.keys() & _BUDGET_KEYS.get(entry.name, {"num_features"})


def budget_options(name: str, budget: int | None, causal: bool, head_dim: int = 32) -> dict[str, Any]:
    """The estimator options that spend ``budget`` per query.

    ``num_features`` such that the feature dimension is ``budget`` (``budget // 2`` for a
    map with two features per ``num_features``, :func:`features_per_unit`) for every
    budgeted estimator except ``sliding-window``, which gets a window of ``budget // 4``
    exact keys (causal; non-causal ``budget // 8`` on each side, ``2w + 1`` keys) and the
    rest as features of its map (rounded down to even, as the two-sided hedgehog map
    needs): the same total per query as a pure feature map.
    """
    base, spec_options = parse_spec(name)
    if budget is None or not has_budget(name):
        return {}
    if get_registry().get(base).name == "sliding-window":
        window = max(1, budget // 4) if causal else max(1, budget // 8)
        exact_keys = window if causal else 2 * window + 1
        features = max(2, (budget - exact_keys) // 2 * 2)
        return {"window": window, "num_features": features}
    per = features_per_unit(base, head_dim, budget, tuple(sorted(spec_options.items())))
    return {"num_features": max(1, budget // per)}


@functools.cache
def features_per_unit(name: str, head_dim: int, num_features: int, options: tuple[tuple[str, Any], ...] = ()) -> int:
    """Feature dimensions per unit of ``num_features`` of estimator ``name`` (with
    ``options``) on heads of width ``head_dim``, probed by building its map with
    ``num_features``: 2 for the cos/sin maps (``rfa``, ``gmm-rks``), 1 for the others, for
    estimators without a feature map and where the map refuses the size (the row's run then
    reports the refusal)."""
    import torch

    from ..api import create

    with torch.random.fork_rng(devices=[]):  # the probe's draws leave the caller's generator as it was
        try:
            fm = getattr(create(name, **dict(options), num_features=num_features), "feature_map", None)
            if fm is None:
                return 1
            fm.build(head_dim)
        except Exception:  # an option the map refuses: the row's own run reports it
            return 1
    return max(1, int(fm.feature_dim) // num_features)


def _summary_stats(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def run_tasks(
    tasks: Sequence[str] | None = None,
    estimators: Sequence[str] | None = None,
    budgets: int | Sequence[int] = DEFAULT_BUDGETS,
    *,
    seeds: int | Sequence[int] = (0,),
    scale: str = "quick",
    steps: int | None = None,
    quadratic: bool = False,
    progress: bool = True,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    recipe: dict[str, Any] | None = None,
    jobs: int = 1,
    device: str | Any | None = None,
    compile: bool | str = False,
    journal: str | os.PathLike[str] | RunJournal | None = None,
) -> list[dict[str, Any]]:
    """Train the task model with each estimator on each task; one record per (task, estimator, budget).

    Parameters
    ----------
    tasks : sequence of str, optional
        Task names (:data:`~kernelattn_core.tasks.TASKS`); ``["mqar"]`` when ``None``.
    estimators : sequence of str, optional
        Registry names, or ``NAME:key=value,...`` specs (:func:`parse_spec`) to run an
        estimator with options; :func:`default_estimators` when ``None``. ``exact`` and the floor
        are always added (the references of every table).
    budgets : int or sequence of int
        Budgets per query (:func:`budget_options`); estimators without one, and specs that
        set their own size (:func:`has_budget`), get one row.
    seeds : int or sequence of int
        Each seed fixes the data, the held-out set and the parameters of one run; distinct.
    scale : {"quick", "paper"}
        Task sizes and training recipe (:data:`RECIPES`).
    steps : int, optional
        Override the recipe's number of steps (every estimator alike).
    quadratic : bool
        With the default estimators, add the quadratic ones (``ra``, ``ra-biased``).
    progress : bool
        A progress bar on a terminal (see :mod:`kernelattn_core.report.progress`).
    on_record : callable, optional
        Called with each record as soon as it is complete.
    recipe : dict, optional
        Further :class:`~kernelattn_core.tasks.train.TrainConfig` overrides (every task).
    jobs : int
        Runs trained at once, each in its own process with
        ``max(1, torch.get_num_threads() // jobs)`` threads (:func:`_run_parallel`). The
        results are those of ``jobs=1`` (every run is seeded by its own seed; a different
        number of threads per run rounds the reductions differently), the records
        come back in the same order; ``on_record`` sees them as they finish. On a 2-core
        CPU two one-thread runs train about 1.3x as many steps per second as one
        two-thread run; every run is slower (its time per step is measured with one thread,
        beside the other job), so compare ``time_per_step_ms`` only within one run of the
        command.
    device : str or torch.device, optional
        Where every run trains (``"cpu"`` by default; ``"cuda"`` trains on the GPU, where the
        estimators with Triton kernels use them). Checked before any training.
    compile : bool or str
        Train every run through ``torch.compile`` (``True``: Inductor, or a backend name;
        :func:`~kernelattn_core.tasks.train.train`):
        worth it for long runs (``scale="paper"``), not at the quick scale, where the
        compilation of each run costs about as much as it saves.
    journal : str, PathLike or RunJournal, optional
        A file (JSON lines, :class:`~kernelattn_core.tasks.journal.RunJournal`) to which
        every finished run is appended as it ends, and from which the runs it already holds
        (the same run, recipe, options, threads per run and code) are taken instead of
        being trained: an interrupted sweep called again with the same journal trains only
        what is missing, and its records equal an uninterrupted call's.

    Returns
    -------
    list of dict
        The records described in the module docstring.
    """
    from ..report.progress import Progress

    tasks, estimators = ([x] if isinstance(x, str) else x for x in (tasks, estimators))  # one name: a list of one
    task_names = list(tasks) if tasks else ["mqar"]
    chosen = [get_task(t) for t in task_names]
    if scale not in ("quick", "paper"):
        raise InputError(f"scale: expected 'quick' or 'paper', got {scale!r}")
    seeds = [seeds] if isinstance(seeds, int) else seeds  # one seed: a list of one
    budgets = [budgets] if isinstance(budgets, int) else budgets
    if not seeds:
        raise InputError("seeds: expected at least one seed, got none")
    for seed in seeds:
        check_positive_int("seeds", seed, 0)
    if len(set(seeds)) < len(seeds):
        twice = sorted({s for s in seeds if list(seeds).count(s) > 1})
        raise InputError(f"seeds: expected distinct seeds (a seed fixes its run), got {twice} more than once")
    for b in budgets:
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise InputError(f"budget: expected positive ints, got {b!r}")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise InputError(f"steps: expected a positive int, got {steps!r}")
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise InputError(f"jobs: expected a positive int, got {jobs!r}")
    where = str(check_device("device", "cpu" if device is None else device))
    run_options = {"device": where, "compile": compile_backend(compile) or False}  # refused here, before any training
    names = list(estimators) if estimators else default_estimators(quadratic=quadratic)
    reg = get_registry()
    for name in names:
        base = parse_spec(name)[0]
        if base not in (EXACT, NO_MIXING):
            reg.get(base)  # unknown names fail here, listing the available ones
    names = [EXACT, NO_MIXING] + [n for n in dict.fromkeys(names) if n not in (EXACT, NO_MIXING)]

    plan: list[tuple[Task, str, int | None, TrainConfig]] = []
    for task in chosen:
        config = RECIPES[(task.name, scale)].updated(steps=steps, **(recipe or {}))
        for name in names:
            plan += [(task, name, b, config) for b in (budgets if has_budget(name) else [None])]
    _check_buildable(plan, scale)  # an option error fails the call, not a row after the references trained
    total = sum(c.steps * len(seeds) for t, n, b, c in plan if cannot_run(n, t) is None)
    if journal is not None and not isinstance(journal, RunJournal):
        journal = RunJournal(journal)
    import torch

    # threads per run are part of a run's identity (another count rounds differently)
    runs = _Runs(journal, torch.get_num_threads() if jobs == 1 else max(1, torch.get_num_threads() // jobs))
    publish = _Publisher(on_record)
    with Progress(total, "tasks", enabled=progress) as bar:
        if jobs == 1:
            for task, name, budget, config in plan:
                publish(_run_row(task, name, budget, config, seeds, scale, bar, run_options, runs))
        else:
            _run_parallel(plan, seeds, scale, bar, jobs, publish, run_options, runs)
    order = {(t.name, n, b): i for i, (t, n, b, _) in enumerate(plan)}
    return sorted(publish.records, key=lambda r: order[(r["task"], r["estimator"], r["budget"])])


@dataclass
class _Runs:
    """Where a call's runs come from: the journal (``None``: none) and the threads each run
    trains with."""

    journal: RunJournal | None
    threads: int

    def key(self, record: dict[str, Any], seed: int, config: TrainConfig) -> dict[str, Any]:
        return run_key(
            record["task"],
            record["estimator"],
            record["budget"],
            seed,
            scale=record["scale"],
            config=asdict(config),
            options=record["options"],
            device=record["device"],
            compiled=record["compiled"],
            threads=self.threads,
        )

    def recorded(self, record: dict[str, Any], seed: int, config: TrainConfig) -> dict[str, Any] | None:
        """The journal's result of this run, or ``None`` (no journal, or not on record)."""
        return None if self.journal is None else self.journal.get(self.key(record, seed, config))

    def record(self, record: dict[str, Any], seed: int, config: TrainConfig, result: dict[str, Any]) -> dict[str, Any]:
        """Append a finished run's result to the journal (not a failed run's); the result as
        the journal holds it (JSON: the curve's pairs become lists), so that a row reads the
        same whether its runs were trained now or taken from the journal."""
        if self.journal is None or "error" in result:
            return result
        return self.journal.add(self.key(record, seed, config), result)


def _check_buildable(plan: list[tuple[Task, str, int | None, TrainConfig]], scale: str) -> None:
    """Build every row's model once (CPU, seed 0; the first task of each estimator, budget
    and direction) so that a bad estimator option is refused before any training, naming
    the estimator: otherwise it would fail its row only, after the references trained."""
    seen = set()
    for task, name, budget, config in plan:
        key = (name, budget, task.causal, config.d_model, config.num_heads)
        if key in seen or cannot_run(name, task) is not None:
            continue
        seen.add(key)
        options = _new_record(task, name, budget, config, (0,), scale, {"device": "cpu", "compile": False})["options"]
        try:
            build_model(task, _registry_name(name), config, scale, 0, options)
        except KernelAttnError as exc:
            raise InputError(f"estimator {name!r}: {exc}") from exc


class _Publisher:
    """Relates each finished record to its task's ceiling and floor and hands it on.

    The two references of a task are related (and shown) once both ran; a row that
    finishes before them (``jobs > 1``) waits for them."""

    def __init__(self, on_record: Callable[[dict[str, Any]], None] | None) -> None:
        self.on_record = on_record
        self.records: list[dict[str, Any]] = []
        self.refs: dict[tuple[str, str], dict[str, Any]] = {}
        self.waiting: dict[str, list[dict[str, Any]]] = {}

    def __call__(self, record: dict[str, Any]) -> None:
        task = record["task"]
        if record["estimator"] in (EXACT, NO_MIXING):
            self.refs[(task, record["estimator"])] = record
        waiting = self.waiting.setdefault(task, [])
        waiting.append(record)
        exact, floor = self.refs.get((task, EXACT)), self.refs.get((task, NO_MIXING))
        if exact is None or floor is None:
            return
        rank = {EXACT: 0, NO_MIXING: 1}
        for r in sorted(waiting, key=lambda r: rank.get(r["estimator"], 2)):  # stable: arrival order after the refs
            _relate(r, exact, floor)
            self.records.append(r)
            if self.on_record is not None:
                self.on_record(r)
        waiting.clear()


def _new_record(
    task: Task,
    name: str,
    budget: int | None,
    config: TrainConfig,
    seeds: Sequence[int],
    scale: str,
    run_options: dict[str, Any],
) -> dict[str, Any]:
    """The row of (``task``, ``name``, ``budget``) before training: its options, or the reason it cannot run."""
    spec_options = parse_spec(name)[1]
    return {
        "task": task.name,
        "estimator": name,
        "budget": budget,
        "options": {**budget_options(name, budget, task.causal, config.d_model // config.num_heads), **spec_options},
        "scale": scale,
        "steps": config.steps,
        "seeds": list(seeds),
        "device": run_options["device"],
        "compiled": run_options["compile"],
        "chance": task.chance(task.config(scale)),
        "accuracy": None,
        "accuracy_std": None,
        "accuracies": [],
        "curves": [],
        "error": cannot_run(name, task),
    }


def _registry_name(name: str) -> str:
    base = parse_spec(name)[0]
    return "softmax" if base == EXACT else base


def _note(record: dict[str, Any], seed: int) -> str:
    """What the progress bar says of a run."""
    budget = "" if record["budget"] is None else f" {record['budget']}"
    return f"{record['task']} {record['estimator']}{budget} seed {seed}"


def _error_text(exc: BaseException) -> str:
    """A failed run's row says why (first line, at most 300 characters)."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def _finish_record(record: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Fill ``record`` from the training results of its seeds (in seed order)."""
    record["accuracies"] = [r["accuracy"] for r in results]
    record["accuracy"], record["accuracy_std"] = _summary_stats(record["accuracies"])
    record["curves"] = [r["curve"] for r in results]
    for key in ("time_per_step_ms", "first_step_s", "peak_mem_mb", "train_s", "first_loss", "last_loss"):
        record[key] = statistics.fmean(r[key] for r in results)
    record["params"] = results[0]["params"]
    return record


def _run_row(
    task: Task,
    name: str,
    budget: int | None,
    config: TrainConfig,
    seeds: Sequence[int],
    scale: str,
    bar: Any,
    run_options: dict[str, Any],
    runs: _Runs,
) -> dict[str, Any]:
    record = _new_record(task, name, budget, config, seeds, scale, run_options)
    if record["error"] is not None:
        return record
    results = []
    for seed in seeds:
        note = _note(record, seed)
        done = runs.recorded(record, seed, config)
        if done is not None:  # finished by an earlier call with this journal
            bar.advance(note, steps=config.steps)
            results.append(done)
            continue
        try:
            result = train(
                task,
                _registry_name(name),
                config,
                scale=scale,
                seed=seed,
                options=record["options"],
                on_step=lambda _step, note=note: bar.advance(note),
                **run_options,
            )
        except Exception as exc:  # a run that fails is a row with its reason, not a crash of the table
            record["error"] = _error_text(exc)
            return record
        results.append(runs.record(record, seed, config, result))
    return _finish_record(record, results)


def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _train_in_worker(
    task_name: str,
    estimator: str,
    config: TrainConfig,
    scale: str,
    seed: int,
    options: dict[str, Any],
    run_options: dict[str, Any],
) -> dict[str, Any]:
    """One run in a worker process; an exception comes back as ``{"error": ...}``."""
    try:
        return train(get_task(task_name), estimator, config, scale=scale, seed=seed, options=options, **run_options)
    except Exception as exc:  # reported in the row, as in a sequential run
        return {"error": _error_text(exc)}


def _run_parallel(
    plan: Sequence[tuple[Task, str, int | None, TrainConfig]],
    seeds: Sequence[int],
    scale: str,
    bar: Any,
    jobs: int,
    publish: Callable[[dict[str, Any]], None],
    run_options: dict[str, Any],
    runs: _Runs,
) -> None:
    """Every (row, seed) of ``plan`` as one job of a pool of ``jobs`` processes (spawned: a
    forked copy of a process whose OpenMP threads have started can hang), submitted longest
    first (by steps); the runs the journal holds are taken from it, not submitted. A row is
    published when its last seed finishes; the progress bar advances by a run's steps when
    it ends. An interrupt stops the pool at once (:func:`_stop`)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    rows = [_new_record(task, name, budget, config, seeds, scale, run_options) for task, name, budget, config in plan]
    results: list[dict[int, dict[str, Any]]] = [{} for _ in plan]

    def finished(i: int, seed: int, out: dict[str, Any]) -> None:
        record = rows[i]
        bar.advance(_note(record, seed), steps=record["steps"])
        results[i][seed] = out
        if len(results[i]) < len(seeds):
            return
        failed = [r["error"] for s in seeds if "error" in (r := results[i][s])]
        if failed:
            record["error"] = failed[0]
        else:
            _finish_record(record, [results[i][s] for s in seeds])
        publish(record)

    for record in rows:
        if record["error"] is not None:
            publish(record)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init, initargs=(runs.threads,)) as pool:
        try:
            futures = {}
            # longest runs first (by steps; the plan's order among equals), so that the pool
            # does not end on one long run while the other workers idle
            for i in sorted(range(len(plan)), key=lambda i: -plan[i][3].steps):
                if rows[i]["error"] is not None:
                    continue
                task, name, _, config = plan[i]
                for seed in seeds:
                    done = runs.recorded(rows[i], seed, config)
                    if done is not None:  # finished by an earlier call with this journal
                        finished(i, seed, done)
                        continue
                    args = (task.name, _registry_name(name), config, scale, seed, rows[i]["options"], run_options)
                    futures[pool.submit(_train_in_worker, *args)] = (i, seed)
            for future in as_completed(futures):
                i, seed = futures[future]
                finished(i, seed, runs.record(rows[i], seed, plan[i][3], future.result()))
        except BaseException:  # an interrupt: stop now, not after every queued run (a journal keeps the finished)
            _stop(pool)
            raise


def _stop(pool: Any) -> None:
    """End a process pool at once: queued runs cancelled, running workers terminated (the
    executor's own shutdown waits for every run already handed to a worker; it has no
    public way to end them, hence its ``_processes``)."""
    workers = list((getattr(pool, "_processes", None) or {}).values())  # shutdown forgets them
    pool.shutdown(wait=False, cancel_futures=True)
    for process in workers:
        process.terminate()


def _relate(record: dict[str, Any], exact: dict[str, Any] | None, floor: dict[str, Any] | None) -> None:
    """Fill the columns that compare a row with the task's ceiling and floor."""
    ceiling = exact.get("accuracy") if exact else None
    bottom = floor.get("accuracy") if floor else None
    record["ceiling"], record["floor"] = ceiling, bottom
    acc = record.get("accuracy")
    record["vs_floor"] = None if acc is None or bottom is None else acc - bottom
    if record["estimator"] in (EXACT, NO_MIXING):
        record["learned"] = None
    else:
        record["learned"] = None if record["vs_floor"] is None else record["vs_floor"] > LEARNED_MARGIN
    steps = None
    # 90 % of a ceiling that learned nothing is chance: no step reaches anything then
    # (a short run's floor and untrained rows read "reached at step 5")
    ceiling_learned = ceiling is not None and bottom is not None and ceiling - bottom > LEARNED_MARGIN
    if ceiling_learned and record["curves"]:
        reached = [steps_to_fraction(c, CEILING_FRACTION * ceiling) for c in record["curves"]]
        reached_steps = [s for s in reached if s is not None]
        if len(reached_steps) * 2 > len(reached):  # most seeds got there: the median is a step
            steps = statistics.median_low([math.inf if s is None else s for s in reached])
    record["steps_to_90"] = steps
    base = exact.get("time_per_step_ms") if exact else None
    mine = record.get("time_per_step_ms")
    record["time_vs_exact"] = None if not base or mine is None else mine / base


def seeds_table(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The papers' Table 2 layout: one row per estimator, one accuracy column per task (%)
    and its time per step relative to exact attention, plus their averages."""
    tasks = list(dict.fromkeys(r["task"] for r in records))
    rows: dict[tuple[str, Any], dict[str, Any]] = {}
    for r in records:
        row = rows.setdefault((r["estimator"], r["budget"]), {"estimator": r["estimator"], "budget": r["budget"]})
        acc = r.get("accuracy")
        row[f"{r['task']} acc"] = None if acc is None else 100 * acc
        row[f"{r['task']} time"] = r.get("time_vs_exact")
    for row in rows.values():
        accs = [row.get(f"{t} acc") for t in tasks]
        times = [row.get(f"{t} time") for t in tasks]
        row["avg acc"] = statistics.fmean(accs) if accs and all(a is not None for a in accs) else None
        row["avg time"] = statistics.fmean(times) if times and all(t is not None for t in times) else None
    return list(rows.values())


def seeds_columns(records: Sequence[dict[str, Any]]) -> list[str]:
    tasks = list(dict.fromkeys(r["task"] for r in records))
    return ["estimator", "budget", *(f"{t} acc" for t in tasks), "avg acc", *(f"{t} time" for t in tasks), "avg time"]


def seeds_formats(columns: Sequence[str]) -> dict[str, str]:
    """How :func:`seeds_table` prints: accuracies (%) with one decimal, time ratios with two."""
    return {c: ".1f" if c.endswith(" acc") else ".2f" for c in columns if c.endswith((" acc", " time"))}


__all__ = [
    "CELL_FORMATS",
    "COLUMNS",
    "CSV_COLUMNS",
    "PRESETS",
    "RECIPES",
    "budget_options",
    "cannot_run",
    "default_estimators",
    "features_per_unit",
    "parse_spec",
    "run_tasks",
    "seeds_columns",
    "seeds_formats",
    "seeds_table",
]
