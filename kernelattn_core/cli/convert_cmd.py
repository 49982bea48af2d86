"""``kernelattn convert``: convert a pretrained model's attention, fit it, report.

Converts every self-attention of a local BERT-family model (``minilm``: the shipped
all-MiniLM-L6-v2) to the chosen estimator, fits the learnable parameters to the
original softmax attention on the fitting text, and reports per layer the attention
output relative error on the evaluation text (by default text that is not in the
project) and the mean cosine of the sentence embeddings to the original's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import InputError, KernelAttnError
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


_SPECIAL_TEXTS = ("shipped", "held-out", "fitting")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _check_count(flag: str, value: int | None, minimum: int, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if value is None or value < minimum:
        raise InputError(f"{flag}: expected an integer >= {minimum}, got {value}")


def _check_output_path(flag: str, path: str | None) -> None:
    """A file that can be written: not a folder, in a folder that exists and is writable
    (checked before any work, not after the whole fit)."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise InputError(f"{flag}: expected a file name, got the folder {path!r}")
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"{flag}: the folder {str(folder)!r} of {path!r} does not exist (create it first)")
    if not os.access(folder, os.W_OK):
        raise InputError(f"{flag}: the folder {str(folder)!r} of {path!r} is not writable")


def _read_texts(flag: str, source: str) -> str:
    """The text of ``--fit-texts`` / ``--eval-texts``: a special name, or a UTF-8 file
    with some text in it."""
    from ..workloads import minilm

    if source in _SPECIAL_TEXTS:
        return minilm.read_texts(source)
    path = Path(source)
    if not path.is_file():
        raise InputError(f"{flag}: expected a readable text file or one of {list(_SPECIAL_TEXTS)}, got {source!r}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{flag}: {source!r} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); "
            "convert it to UTF-8"
        ) from None
    except OSError as exc:
        raise InputError(f"{flag}: cannot read {source!r}: {_one_line(exc)}") from None
    if not text.strip():
        raise InputError(f"{flag}: {source!r} holds no text")
    return text


def _check_device(name: str) -> Any:
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise InputError(f"--device: expected a torch device such as 'cpu' or 'cuda:0', got {name!r}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device: {name!r} was asked for, but this torch has no CUDA device (use --device cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise InputError(f"--device: {name!r} was asked for, but there are {torch.cuda.device_count()} CUDA devices")
    try:
        torch.empty(1, device=device)
    except Exception as exc:  # another device type this build or machine does not have
        raise InputError(f"--device: {name!r} is not usable here: {_one_line(exc)}") from None
    return device


def _model_config(model: str) -> tuple[Path, dict[str, Any]]:
    """The model folder and its ``config.json``, read as a JSON object."""
    from ..workloads import minilm

    path = minilm.resolve_model_dir(model)
    config = path / "config.json"
    try:
        data = json.loads(config.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"MODEL_DIR: {str(config)!r} is not a valid JSON file: {_one_line(exc)}") from None
    if not isinstance(data, dict):
        raise InputError(f"MODEL_DIR: {str(config)!r} must hold a JSON object, got a {type(data).__name__}")
    return path, data


def validate(args: argparse.Namespace) -> dict[str, Any]:
    """Every argument of ``convert``, checked before any work (no model is loaded and
    nothing is fitted before an argument is refused): returns the estimator options, the
    device, the model folder and both texts. Each refusal is an
    :class:`~kernelattn_core.errors.InputError` of one line naming the argument."""
    from ..convert import _check_options
    from ..module import build_estimator

    options = estimator_options(args)
    _check_count("--budget", args.budget, 1, none_ok=True)
    _check_count("--window", args.window, 0, none_ok=True)
    _check_count("--steps", args.steps, 0)
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise InputError(f"--lr: expected a positive finite learning rate, got {args.lr}")
    _check_count("--rows", args.rows, 1)
    _check_count("--max-length", args.max_length, 3)
    _check_count("--fit-sequences", args.fit_sequences, 1, none_ok=True)
    _check_count("--eval-sequences", args.eval_sequences, 1)
    _check_count("--sentences", args.sentences, 1)
    _check_output_path("--output", args.output)
    _check_output_path("--save", args.save)
    device = _check_device(args.device)
    path, config = _model_config(args.model)
    longest = config.get("max_position_embeddings")
    if isinstance(longest, int) and args.max_length > longest:
        raise InputError(f"--max-length: the model takes at most {longest} positions, got {args.max_length}")
    _check_options(args.estimator, options)
    heads, width = config.get("num_attention_heads"), config.get("hidden_size")
    if isinstance(heads, int) and isinstance(width, int) and heads > 0 and width % heads == 0:
        try:  # the options, as the first converted layer will build them
            build_estimator(args.estimator, width // heads, heads, options)
        except TypeError as exc:
            raise InputError(f"--option: {_one_line(exc)}") from None
    fit_text = _read_texts("--fit-texts", args.fit_texts)
    eval_text = _read_texts("--eval-texts", args.eval_texts)
    from ..workloads import minilm

    if not minilm.sentences(eval_text):
        raise InputError(f"--eval-texts: {args.eval_texts!r} holds no sentence of four words or more to embed")
    return {"options": options, "device": device, "model": path, "fit_text": fit_text, "eval_text": eval_text}


def run(args: argparse.Namespace) -> int:
    """Convert, fit and report (see the module docstring)."""
    import torch

    from ..convert import convert_attention, distill_attention, output_errors
    from ..workloads import minilm

    checked = validate(args)  # every argument, before any work
    options, device = checked["options"], checked["device"]
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    torch.manual_seed(args.seed)
    try:
        teacher, tokenizer = minilm.load_model(checked["model"], dtype=dtype)
    except KernelAttnError:
        raise
    except Exception as exc:  # a folder transformers cannot read: one line, not its traceback
        raise InputError(f"MODEL_DIR: cannot load {str(checked['model'])!r}: {_one_line(exc)}") from None
    teacher = teacher.to(device)
    student = convert_attention(teacher, args.estimator, **options)

    def on_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in batch.items()}

    fit = on_device(
        minilm.pack(tokenizer, checked["fit_text"], max_length=args.max_length, max_sequences=args.fit_sequences)
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
    eval_text = checked["eval_text"]
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
