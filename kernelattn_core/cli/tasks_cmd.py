"""``kernelattn tasks``: arguments (torch-free, for an instant ``--help``) and the run."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..report.output import add_output_arguments

TASK_NAMES = ("mqar", "listops", "selective-copy", "induction")  # kept equal to tasks.TASKS by a test
PRESET_NAMES = ("seeds", "zoology")  # kept equal to tasks.run.PRESETS by a test

DESCRIPTION = """\
Train the same small Transformer (2 layers, width 64, 2 heads) with each estimator on generated
tasks and report what it learned: held-out accuracy (mean and std over seeds), steps to 90 % of
exact attention's accuracy, time per training step and peak memory. Every table has two
references: exact (softmax attention, the ceiling) and baseline:no-mixing (the same model
without attention, the floor); learned=no marks an estimator that does not beat the floor.

Tasks (generated in-process from the seed, no downloads):
  mqar            multi-query associative recall (Zoology): recall the value of each key
  listops         nested MIN/MAX/MED/SUM-MOD expressions, 10 classes (Long Range Arena)
  selective-copy  copy the data tokens scattered among noise (Mamba)
  induction       complete a repeated pattern (induction heads)

By default: --task mqar, budget 64, seed 0, every estimator linear in the sequence length.
At the quick scale one (task, estimator, budget, seed) takes 4-45 s on two cores; rows
stream as they finish. --jobs N trains N runs at once, each in its own process (on a
2-core CPU --jobs 2 trains about 1.3x as many steps per second, each run about 1.5x
slower). --device cuda trains on
a GPU; --compile trains through torch.compile (a CPU step of a linear estimator 0.67-0.87x
the eager one, after 10-40 s of compilation per run: worth it for --scale paper, not at the
quick scale). Presets:
  --preset seeds    the five source papers' estimators (+ hedgehog, sliding-window) on every
                    task, in the layout of their Table 2 (26 min on 2 cores, every run <= 45 s)
  --preset zoology  MQAR against the feature budget 16..256 for prf, hedgehog, elu and
                    sliding-window, two seeds (Zoology's Fig. 2 at CPU scale)
--journal FILE keeps every finished run, so a long sweep that stops resumes where it stopped.
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "tasks",
        help="train a small model with each estimator on generated tasks (MQAR, ListOps, ...)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", action="append", choices=TASK_NAMES, metavar="NAME", help="a task (repeatable)")
    p.add_argument(
        "--estimator",
        action="append",
        metavar="NAME",
        help="a registry name or alias, or NAME:key=value,... with options (repeatable; e.g. hedgehog:init=prf)",
    )
    p.add_argument("--budget", action="append", type=int, metavar="D", help="budget per query (repeatable; 64)")
    p.add_argument("--seeds", nargs="+", action="extend", type=int, metavar="S", help="seeds (default: 0; repeatable)")
    p.add_argument("--steps", type=int, metavar="N", help="training steps (default: the task's recipe)")
    p.add_argument("--scale", choices=("quick", "paper"), default="quick", help="task sizes and recipe (quick)")
    p.add_argument("--preset", choices=PRESET_NAMES, help="a named selection (see above)")
    p.add_argument("--quadratic", action="store_true", help="also the estimators quadratic in the length (ra, ...)")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="runs trained at once, each in its own process with threads/N threads (1; the same results)",
    )
    p.add_argument("--device", default="cpu", metavar="DEV", help="where to train: cpu, cuda, cuda:1, ... (cpu)")
    p.add_argument(
        "--compile",
        nargs="?",
        const=True,
        default=False,
        metavar="BACKEND",
        help="train through torch.compile (Inductor, or the backend named; pays off on long runs: --scale paper)",
    )
    p.add_argument(
        "--journal",
        metavar="FILE",
        help="append every finished run to FILE (JSON lines) and reuse the runs it already holds "
        "(same run, recipe, threads per run and code): an interrupted sweep, run again, trains only what is missing",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is off anyway when not a terminal)")
    add_output_arguments(p)
    p.set_defaults(func=run)


def _positive(name: str, values: list[int] | None) -> None:
    from ..errors import InputError

    for v in values or ():
        if v < 1:
            raise InputError(f"{name}: expected a positive integer, got {v}")


def run(args: argparse.Namespace) -> int:
    from ..errors import InputError

    _positive("--budget", args.budget)
    _positive("--steps", [args.steps] if args.steps is not None else None)
    _positive("--jobs", [args.jobs])
    if args.seeds is not None and any(s < 0 for s in args.seeds):
        raise InputError(f"--seeds: expected integers >= 0, got {args.seeds}")
    from ..report.output import RowStream, emit, resolve_format, table
    from ..tasks.figures import check_output_paths, tasks_figure
    from ..tasks.run import (
        CELL_FORMATS,
        COLUMNS,
        CSV_COLUMNS,
        PRESETS,
        WIDTHS,
        run_tasks,
        seeds_columns,
        seeds_formats,
        seeds_table,
    )
    from ..validation import check_device

    check_device("--device", args.device)
    if args.compile is not False:
        from ..tasks.train import compile_backend

        compile_backend(args.compile, "--compile")
    check_output_paths(args.plot, args.output)  # fail before the work, not after it
    journal = None
    if args.journal:
        from ..tasks.journal import RunJournal

        journal = RunJournal(args.journal)  # a bad path fails here, before any training
        if journal.opening() is not None:  # resuming: say so before the first row
            print(journal.opening(), file=sys.stderr)
    fmt = resolve_format(args.format, args.output)
    preset = PRESETS[args.preset] if args.preset else None
    tasks = args.task or (list(preset.tasks) if preset else None)
    estimators = args.estimator or (list(preset.estimators) if preset else None)
    budgets = args.budget or (list(preset.budgets) if preset else [64])
    seeds = args.seeds if args.seeds is not None else (list(preset.seeds) if preset else [0])
    to_stdout = not args.output and fmt != "table"
    # the estimator column as wide as the longest name asked for (rows stream in, so the
    # widths are fixed before the first one)
    longest = max((len(e) for e in estimators or []), default=0)
    widths = {**WIDTHS, "estimator": max(WIDTHS["estimator"], longest)}
    stream = None if to_stdout else RowStream(COLUMNS, widths, formats=CELL_FORMATS)
    try:
        records = run_tasks(
            tasks,
            estimators,
            budgets,
            seeds=seeds,
            scale=args.scale,
            steps=args.steps,
            quadratic=args.quadratic,
            progress=not args.no_progress,
            on_record=stream.row if stream is not None else None,
            jobs=args.jobs,
            device=args.device,
            compile=args.compile,
            journal=journal,
        )
    except KeyboardInterrupt:
        if journal is not None:  # what the next call will reuse
            print(f"\ninterrupted; {journal.summary()}: the same command resumes from it", file=sys.stderr)
        raise
    out = sys.stderr if to_stdout else sys.stdout
    if journal is not None:
        print(journal.summary(), file=sys.stderr)
    if args.output or to_stdout:
        emit(records, COLUMNS if fmt == "table" else CSV_COLUMNS, fmt, args.output)
    if args.preset == "seeds" or len({r["task"] for r in records}) > 1:
        print("\naccuracy (%) per task and time per step relative to exact attention:", file=out)
        columns = seeds_columns(records)
        print(table(seeds_table(records), columns, seeds_formats(columns)), file=out)
    not_learned = [r["estimator"] for r in records if r.get("learned") is False]
    if not_learned:
        print(f"\ndid not beat the floor (learned=no): {', '.join(dict.fromkeys(not_learned))}", file=out)
    failed = [r for r in records if r["error"]]
    if failed:
        print(f"{len(failed)} row(s) without a result; see the error column", file=out)
    if records and (records[0]["device"] != "cpu" or records[0]["compiled"]):
        how = f", compiled ({records[0]['compiled']})" if records[0]["compiled"] else ""
        print(f"trained on {records[0]['device']}{how}: compare times only with runs trained the same way", file=out)
    if args.plot:
        print(f"plot written to {tasks_figure(records, args.plot)}", file=out)
    return 0
