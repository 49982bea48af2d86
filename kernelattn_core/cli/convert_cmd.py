"""``kernelattn convert``: convert a pretrained model's attention, fit it, report.

Converts every self-attention of a local BERT-family model (``minilm``: the shipped
all-MiniLM-L6-v2) to the chosen estimator, fits the learnable parameters to the
original softmax attention on the fitting text, and reports per layer the attention
output relative error on the evaluation text (by default text that is not in the
project) and the mean cosine of the sentence embeddings to the original's.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..errors import InputError
from .output import table, to_json

COLUMNS = ("layer", "name", "output_rel_error", "fit_error_before", "fit_error_after", "fit_seconds")


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with the value read as int, float, bool (true/false), none or str."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise InputError(f"--option: expected KEY=VALUE, got {text!r}")
    low = raw.lower()
    value: Any
    if low in ("true", "false"):
        value = low == "true"
    elif low in ("none", "null"):
        value = None
    else:
        try:
            value = int(raw)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                value = raw
    return key.replace("-", "_"), value


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``convert`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "convert",
        help="convert a pretrained model's attention, fit it to the original, report per-layer error",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL_DIR", help="local model folder, or 'minilm' for the shipped MiniLM")
    p.add_argument("--estimator", required=True, metavar="NAME", help="registry name (kernelattn plugins)")
    p.add_argument("--budget", type=int, metavar="M", help="num_features of the estimator")
    p.add_argument("--window", type=int, metavar="W", help="window option of the estimator (sliding-window)")
    p.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE", help="any other estimator option (repeatable)"
    )
    p.add_argument(
        "--fit-texts",
        default="fitting",
        metavar="FILE",
        help="fitting text: a file, 'shipped' (the shipped prose) or 'fitting' (default: the shipped prose and "
        "the documentation of other standard-library modules than the held-out ones)",
    )
    p.add_argument("--eval-texts", default="held-out", metavar="FILE", help="evaluation text (default: held-out)")
    p.add_argument("--steps", type=int, default=200, help="Adam steps per layer (0: no fitting)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--loss", choices=("ce", "mse"), default="ce")
    p.add_argument("--rows", type=int, default=128, help="query rows per fitting step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-length", type=int, default=512, help="tokens per packed sequence (N)")
    p.add_argument("--fit-sequences", type=int, default=None, help="packed fitting sequences (default: all)")
    p.add_argument("--eval-sequences", type=int, default=4, help="packed evaluation sequences")
    p.add_argument("--sentences", type=int, default=256, help="evaluation sentences for the embedding cosine")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--save", metavar="FILE", help="save the converted model's state_dict (torch.save)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--output", metavar="FILE", help="write the report here instead of stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)
    return p


def estimator_options(args: argparse.Namespace) -> dict[str, Any]:
    """The estimator options from ``--budget``, ``--window`` and ``--option``."""
    options: dict[str, Any] = dict(parse_option(o) for o in args.option)
    if args.budget is not None:
        options["num_features"] = args.budget
    if args.window is not None:
        options["window"] = args.window
    return options


def run(args: argparse.Namespace) -> int:
    """Convert, fit and report (see the module docstring)."""
    import torch

    from ..convert import convert_attention, distill_attention, output_errors
    from ..workloads import minilm

    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    options = estimator_options(args)
    torch.manual_seed(args.seed)
    teacher, tokenizer = minilm.load_model(args.model, dtype=dtype)
    teacher = teacher.to(args.device)
    student = convert_attention(teacher, args.estimator, **options)

    def on_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(args.device) for k, v in batch.items()}

    fit = on_device(
        minilm.pack(
            tokenizer, minilm.read_texts(args.fit_texts), max_length=args.max_length, max_sequences=args.fit_sequences
        )
    )
    progress = None if not args.no_progress else False
    report = distill_attention(
        student,
        teacher,
        [fit],
        steps=args.steps,
        lr=args.lr,
        loss=args.loss,
        rows=args.rows,
        seed=args.seed,
        progress=progress,
    )
    eval_text = minilm.read_texts(args.eval_texts)
    evaluation = on_device(
        minilm.pack(tokenizer, eval_text, max_length=args.max_length, max_sequences=args.eval_sequences)
    )
    student.eval()
    errors = output_errors(student, teacher, [evaluation])
    t0 = time.perf_counter()
    cosine = minilm.embedding_cosine(teacher, student, tokenizer, minilm.sentences(eval_text)[: args.sentences])
    records: list[dict[str, Any]] = []
    for err, fitted in zip(errors, report.layers):
        records.append(
            {
                **err,
                "fit_error_before": fitted.error_before,
                "fit_error_after": fitted.error_after,
                "loss_before": fitted.loss_before,
                "loss_after": fitted.loss_after,
                "parameters": fitted.parameters,
                "fit_seconds": fitted.seconds,
            }
        )
    summary = {
        "summary": True,
        "model": str(args.model),
        "estimator": args.estimator,
        "options": {k: v for k, v in options.items()},
        "eval_texts": str(args.eval_texts),
        "max_output_rel_error": max(r["output_rel_error"] for r in records),
        "mean_output_rel_error": sum(r["output_rel_error"] for r in records) / len(records),
        "embedding_cosine": cosine,
        "sentences": min(args.sentences, len(minilm.sentences(eval_text))),
        "fit_seconds": report.seconds,
        "embedding_seconds": time.perf_counter() - t0,
        "steps": args.steps,
        "loss": args.loss,
    }
    if args.save:
        torch.save(student.state_dict(), args.save)
    if args.format == "json":
        text = to_json([*records, summary])
    else:
        lines = [
            f"{args.estimator} {options} on {args.model}: attention-output relative error on {args.eval_texts}",
            table(records, COLUMNS),
            "",
            f"max output_rel_error   {summary['max_output_rel_error']:.4f}",
            f"embedding_cosine       {cosine:.6f}  ({summary['sentences']} sentences, mean pooling)",
            f"fit_seconds            {report.seconds:.1f}  ({args.steps} steps/layer, loss {args.loss})",
        ]
        text = "\n".join(lines)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")
    return 0
