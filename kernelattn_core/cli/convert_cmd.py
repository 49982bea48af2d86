"""``kernelattn convert``: convert a pretrained model's attention, fit it, report.

Converts every self-attention of a local BERT-family model (``minilm``: the shipped
all-MiniLM-L6-v2) to the chosen estimator and fits it in up to two stages, each
optional: (1) every layer's learnable parameters to the original softmax attention on
the fitting text (``--steps``); (2) the whole model end to end on its hidden states and
sentence embeddings over long packed passages of the fitting text (``--e2e-steps``,
optionally with low-rank adapters, ``--lora-rank``). It reports per layer the attention
output relative error on the evaluation texts (by default three genres that are not in
the fitting text), and the embedding cosine to the original by length bucket and on
packed passages of 128 and 512 tokens (the headline: 512-token passages), with
nearest-neighbour agreement and the Spearman correlation of the similarity matrices.

A local decoder checkpoint (GPT-2, Llama, Mistral, Qwen2, ...: its ``config.json`` names
a ``...ForCausalLM`` / ``...LMHeadModel`` architecture) is converted and fitted in the
same two stages: (1) every layer to the original softmax attention (``--steps``); (2) the
whole model end to end on the original's next-token distribution (``--e2e-steps``,
optionally with low-rank adapters, ``--lora-rank``; early-stopped on the last tenth of
the fitting text). It is reported by held-out perplexity of the original and the
converted model on each evaluation text (:mod:`kernelattn_core.cli.convert_decoder`);
``--save DIR`` then writes ``save_pretrained`` output that
``kernelattn_core.convert.from_pretrained`` reloads. The sentence-embedding options
(``--sentences``, ``--passages``, ``--allocate*``, ``--e2e-weight``, ``--e2e-length``,
``--e2e-batch``) are for encoders and refused for a decoder.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import InputError, KernelAttnError
from ..report.output import table, to_json
from .convert_shared import (  # noqa: F401  (re-exported: tests and plugins read them here)
    _SPECIAL_TEXTS,
    ENCODER_ONLY,
    _check_output_path,
    _one_line,
    _read_texts,
    _share,
    _stage,
)


class _Given(argparse.Action):
    """Store the value and remember that the option was given (``args.given``), so that an
    option that means nothing for the model found is refused rather than ignored."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        given = set(getattr(namespace, "given", None) or ())
        given.add(option_string)
        namespace.given = given


#: options that only mean something for an encoder (sentence embeddings, allocation, passages)

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


def _plain(text: str | None) -> str:
    """A docstring as ``--help`` text: reStructuredText roles and literals unmarked."""
    import re

    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], text or "")
    return text.replace("``", "")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``convert`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "convert",
        help="convert a pretrained model's attention, fit it to the original, report per-layer error",
        description=_plain(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        metavar="MODEL_DIR",
        help="local model folder (a BERT-family encoder or a causal decoder LM), or 'minilm' for the shipped MiniLM",
    )
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
    p.add_argument(
        "--eval-texts",
        nargs="+",
        default=["held-out", "legal", "narrative"],
        metavar="FILE",
        help="evaluation texts: files or names (held-out, legal, narrative, shipped, fitting); default: the three "
        "held-out genres held-out (standard-library documentation), legal (a contract) and narrative (a story)",
    )
    p.add_argument("--steps", type=int, default=200, help="Adam steps per layer (0: no fitting; 200)")
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate of the per-layer fit (0.01)")
    p.add_argument("--loss", choices=("ce", "mse"), default="ce")
    p.add_argument("--rows", type=int, default=128, help="query rows per fitting step")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of every draw: the estimators' features, the fitting passages and rows (0)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="tokens per packed sequence (N; default 512 for an encoder; for a decoder the context its teacher.json "
        "records, else 256)",
    )
    p.add_argument("--fit-sequences", type=int, default=None, help="packed fitting sequences (default: all)")
    p.add_argument(
        "--eval-sequences",
        type=int,
        default=None,
        help="packed evaluation sequences per text (default 4 for an encoder; every one for a decoder)",
    )
    p.add_argument(
        "--sentences",
        type=int,
        default=256,
        action=_Given,
        help="evaluation sentences per text for the embedding figures",
    )
    p.add_argument(
        "--passages", type=int, default=16, action=_Given, help="packed evaluation pieces per length and text (64-512)"
    )
    p.add_argument(
        "--allocate",
        type=int,
        action=_Given,
        metavar="TOTAL",
        help="per layer, split TOTAL exact-plus-feature keys per query between --window and --budget by a brief fit "
        "of each --allocate-windows candidate, judged on a validation slice of the fitting text (sliding-window)",
    )
    p.add_argument(
        "--allocate-windows",
        default="8,16,24,32,40,48,56",
        action=_Given,
        metavar="W,W,...",
        help="candidate windows of --allocate",
    )
    p.add_argument(
        "--allocate-heavy",
        default=None,
        action=_Given,
        metavar="S,S,...",
        help="candidate numbers of heavy keys of --allocate (sliding-window's heavy_keys: each head's keys of largest "
        "estimated attention mass, exact for every query; default: --option heavy_keys if given, else 0)",
    )
    p.add_argument("--allocate-steps", type=int, default=150, action=_Given, help="steps of each candidate's brief fit")
    p.add_argument("--e2e-steps", type=int, default=0, help="end-to-end steps after the per-layer fit (0: no stage 2)")
    p.add_argument("--e2e-lr", type=float, default=2e-3, help="learning rate of the end-to-end stage")
    p.add_argument(
        "--e2e-length",
        default=None,
        action=_Given,
        metavar="N[,N...]",
        help="tokens per end-to-end passage; several lengths are taken in turn (default --max-length)",
    )
    p.add_argument(
        "--e2e-weight",
        type=float,
        action=_Given,
        default=10.0,
        help="weight of the sentence-embedding cosine term against the hidden-state term (end-to-end)",
    )
    p.add_argument("--e2e-batch", type=int, default=1, action=_Given, help="passages per end-to-end step")
    p.add_argument("--lora-rank", type=int, default=0, help="rank of q/k/v adapters in the end-to-end stage (0: none)")
    p.add_argument("--anchor", type=float, default=1e-3, help="pull of the end-to-end stage towards its start (L2-SP)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="model dtype (float32)")
    p.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:1, ... (cpu)")
    p.add_argument(
        "--save",
        metavar="FILE|DIR",
        help="encoder: save the converted model's state_dict to FILE (torch.save); decoder: save_pretrained into "
        "DIR (with the tokenizer), which kernelattn_core.convert.from_pretrained reloads",
    )
    p.add_argument("--format", choices=("table", "json"), default="table", help="how the report is written (table)")
    p.add_argument("--output", metavar="FILE", help="write the report here instead of stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)
    return p


def estimator_options(args: argparse.Namespace) -> dict[str, Any]:
    """The estimator options from ``--budget``, ``--window`` and ``--option``."""
    options: dict[str, Any] = dict(parse_option(o) for o in args.option)
    for flag, key, value in (("--budget", "num_features", args.budget), ("--window", "window", args.window)):
        if value is None:
            continue
        if key in options and options[key] != value:  # two answers to one question: say so, pick neither
            raise InputError(f"{flag}: {value} conflicts with --option {key}={options[key]}; give one of them")
        options[key] = value
    return options


def _worst(values: Iterable[Any]) -> float:
    """The smallest of the texts' figures, NaN (a text without passages of that length)
    skipped whatever its place; NaN when no text has the figure."""
    found = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return min(found) if found else math.nan


def _check_count(flag: str, value: int | None, minimum: int, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if value is None or value < minimum:
        raise InputError(f"{flag}: expected an integer >= {minimum}, got {value}")


def _check_device(name: str) -> Any:
    from ..validation import check_device

    return check_device("--device", name)


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


def _lengths(text: str | None, default: int) -> list[int]:
    if text is None:
        return [default]
    try:
        lengths = [int(n) for n in str(text).split(",") if n.strip()]
    except ValueError:
        raise InputError(f"--e2e-length: expected comma-separated integers, got {text!r}") from None
    if not lengths or min(lengths) < 3:
        raise InputError(f"--e2e-length: expected lengths >= 3 (CLS, one token, SEP), got {text!r}")
    return lengths


def _windows(text: str, flag: str = "--allocate-windows") -> list[int]:
    try:
        windows = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise InputError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not windows or min(windows) < 0:
        raise InputError(f"{flag}: expected integers >= 0, got {text!r}")
    return windows


def _heavy(args: argparse.Namespace, options: dict[str, Any]) -> list[int]:
    """The heavy-key candidates of ``--allocate``: ``--allocate-heavy``, else the
    estimator's ``heavy_keys`` option, else none."""
    if args.allocate_heavy is None:
        return [int(options.get("heavy_keys", 0))]
    if "heavy_keys" in options:
        raise InputError(
            f"--allocate-heavy: candidates {args.allocate_heavy!r} given with --option heavy_keys="
            f"{options['heavy_keys']}: give the heavy keys one way"
        )
    return _windows(args.allocate_heavy, "--allocate-heavy")


def validate(args: argparse.Namespace) -> dict[str, Any]:
    """Every argument of ``convert``, checked before any work (no model is loaded and
    nothing is fitted before an argument is refused): returns the estimator options, the
    device, the model folder and both texts. Each refusal is an
    :class:`~kernelattn_core.errors.InputError` of one line naming the argument."""
    from ..convert.attention import _check_options
    from ..module import build_estimator

    options = estimator_options(args)
    _check_count("--budget", args.budget, 1, none_ok=True)
    _check_count("--window", args.window, 0, none_ok=True)
    _check_count("--steps", args.steps, 0)
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise InputError(f"--lr: expected a positive finite learning rate, got {args.lr}")
    _check_count("--rows", args.rows, 1)
    _check_count("--max-length", args.max_length, 3, none_ok=True)
    _check_count("--fit-sequences", args.fit_sequences, 1, none_ok=True)
    _check_count("--eval-sequences", args.eval_sequences, 1, none_ok=True)
    _check_count("--sentences", args.sentences, 1)
    _check_count("--passages", args.passages, 1)
    _check_count("--e2e-steps", args.e2e_steps, 0)
    _check_count("--allocate", args.allocate, 4, none_ok=True)
    _check_count("--allocate-steps", args.allocate_steps, 1)
    windows = _windows(args.allocate_windows)
    heavy = _heavy(args, options)
    lone = sorted(f for f in getattr(args, "given", None) or () if f.startswith("--allocate-"))
    if lone and args.allocate is None:
        raise InputError(f"{lone[0]}: sets the candidates of --allocate TOTAL, which is not given")
    if args.allocate is not None:
        from ..convert.allocate import split_candidates

        if not split_candidates(args.allocate, windows, int(options.get("global_tokens", 0)), heavy):
            raise InputError(
                f"--allocate-windows: no window of {windows} (with heavy keys {heavy}) leaves features within "
                f"--allocate {args.allocate}"
            )
    _check_count("--e2e-batch", args.e2e_batch, 1)
    lengths = _lengths(args.e2e_length, args.max_length or 512)
    if not math.isfinite(args.e2e_weight) or args.e2e_weight < 0:
        raise InputError(f"--e2e-weight: expected a finite number >= 0, got {args.e2e_weight}")
    _check_count("--lora-rank", args.lora_rank, 0)
    if not math.isfinite(args.e2e_lr) or args.e2e_lr <= 0:
        raise InputError(f"--e2e-lr: expected a positive finite learning rate, got {args.e2e_lr}")
    if not math.isfinite(args.anchor) or args.anchor < 0:
        raise InputError(f"--anchor: expected a finite number >= 0, got {args.anchor}")
    _check_output_path("--output", args.output)
    device = _check_device(args.device)
    path, config = _model_config(args.model)
    from . import convert_decoder

    if convert_decoder.is_decoder_config(config):  # a causal LM: held-out perplexity, save_pretrained
        return convert_decoder.validate(args, options, device, path, config)
    _check_output_path("--save", args.save)
    if args.max_length is None:
        args.max_length = 512
    if args.eval_sequences is None:
        args.eval_sequences = 4
    longest = config.get("max_position_embeddings")
    if isinstance(longest, int) and args.max_length > longest:
        raise InputError(f"--max-length: the model takes at most {longest} positions, got {args.max_length}")
    if isinstance(longest, int) and max(lengths) > longest:
        raise InputError(f"--e2e-length: the model takes at most {longest} positions, got {max(lengths)}")
    _check_options(args.estimator, options)
    heads, width = config.get("num_attention_heads"), config.get("hidden_size")
    if isinstance(heads, int) and isinstance(width, int) and heads > 0 and width % heads == 0:
        try:  # the options, as the first converted layer will build them
            build_estimator(args.estimator, width // heads, heads, options)
        except TypeError as exc:
            raise InputError(f"--option: {_one_line(exc)}") from None
    fit_text = _read_texts("--fit-texts", args.fit_texts)
    from ..workloads import minilm

    eval_texts: dict[str, str] = {}
    for source in args.eval_texts:
        text = _read_texts("--eval-texts", source)
        if not minilm.sentences(text):
            raise InputError(f"--eval-texts: {source!r} holds no sentence of four words or more to embed")
        eval_texts[source] = text
    return {"options": options, "device": device, "model": path, "fit_text": fit_text, "eval_texts": eval_texts}


def run(args: argparse.Namespace) -> int:
    """Convert, fit and report (see the module docstring)."""
    import torch

    from ..convert import convert_attention, distill_attention, output_errors
    from ..convert.e2e import finetune_end_to_end
    from ..convert.report import embedding_report
    from ..report.progress import progress_wanted
    from ..workloads import minilm

    checked = validate(args)  # every argument, before any work
    if checked.get("decoder"):
        from .convert_decoder import run as run_decoder

        return run_decoder(args, checked)
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
    fit_text, eval_texts = checked["fit_text"], checked["eval_texts"]
    overlaps = {name: minilm.overlap(text, fit_text) for name, text in eval_texts.items()}
    for name, share in overlaps.items():
        if share > 0:
            sys.stderr.write(
                f"kernelattn: warning: {_share(share)} of the sentences of --eval-texts {name!r} are also in the "
                "fitting text: its figures are not wholly held out\n"
            )

    def on_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in batch.items()}

    progress = None if not args.no_progress else False
    talk = progress_wanted(sys.stderr, not args.no_progress)
    start = time.perf_counter()
    fit = on_device(minilm.pack(tokenizer, fit_text, max_length=args.max_length, max_sequences=args.fit_sequences))
    allocation = None
    if args.allocate is not None:
        from ..convert.allocate import allocate_budget, split_candidates

        windows = _windows(args.allocate_windows)
        heavy = _heavy(args, options)
        count = len(split_candidates(args.allocate, windows, int(options.get("global_tokens", 0)), heavy))
        _stage(f"allocation: {count} window/heavy-key/feature splits of {args.allocate} per layer", talk)
        part = minilm.random_passages(
            tokenizer, fit_text, length=args.max_length, count=8, seed=args.seed, part=(0, 0.9)
        )
        check = minilm.random_passages(
            tokenizer, fit_text, length=args.max_length, count=2, seed=args.seed + 1, part=(0.9, 1)
        )
        allocation = allocate_budget(
            student,
            teacher,
            [on_device(part)],
            [on_device(check)],
            estimator=args.estimator,
            options={k: v for k, v in options.items() if k != "heavy_keys"},
            budget=args.allocate,
            windows=windows,
            heavy=heavy,
            steps=args.allocate_steps,
            lr=args.lr,
            rows=args.rows,
            loss=args.loss,
            seed=args.seed,
            progress=progress,
        )
    _stage(f"stage 1: per-layer attention fit, {args.steps} steps per layer", talk and args.steps > 0)
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
    e2e = None
    if args.e2e_steps:
        lengths = _lengths(args.e2e_length, args.max_length)
        size = args.e2e_batch
        _stage(
            f"stage 2: end-to-end fit, {args.e2e_steps} steps of {size} passage(s) of {'/'.join(map(str, lengths))} "
            "tokens",
            talk,
        )
        batches: list[Any] = []
        validation = []
        for j, length in enumerate(lengths):  # every length takes its turn
            count = len(range(j, args.e2e_steps, len(lengths)))
            train = minilm.random_passages(
                tokenizer, fit_text, length=length, count=max(1, count) * size, seed=args.seed + j, part=(0, 0.9)
            )
            batches.append(
                [on_device({k: v[i * size : (i + 1) * size] for k, v in train.items()}) for i in range(count)]
            )
            held = minilm.random_passages(
                tokenizer, fit_text, length=length, count=2, seed=args.seed + 100 + j, part=(0.9, 1)
            )
            validation.append(on_device(held))
        batches = [batches[s % len(lengths)][s // len(lengths)] for s in range(args.e2e_steps)]
        e2e = finetune_end_to_end(
            student,
            teacher,
            batches,
            validation=validation,
            steps=args.e2e_steps,
            lr=args.e2e_lr,
            lora_rank=args.lora_rank,
            anchor=args.anchor,
            embedding_weight=args.e2e_weight,
            seed=args.seed,
            eval_every=max(1, args.e2e_steps // 10),
            progress=progress,
        )
    fit_seconds = time.perf_counter() - start
    student.eval()
    _stage("evaluation", talk)
    per_text = {}
    for name, text in eval_texts.items():
        evaluation = on_device(
            minilm.pack(tokenizer, text, max_length=args.max_length, max_sequences=args.eval_sequences)
        )
        per_text[name] = output_errors(student, teacher, [evaluation])
    t0 = time.perf_counter()
    embeddings = [
        embedding_report(
            teacher,
            student,
            tokenizer,
            text,
            name=name,
            max_sentences=args.sentences,
            max_pieces=args.passages,
            max_length=args.max_length,
        )
        for name, text in eval_texts.items()
    ]
    records: list[dict[str, Any]] = []
    first = next(iter(per_text))
    for index, fitted in enumerate(report.layers):
        errors = {name: rows[index]["output_rel_error"] for name, rows in per_text.items()}
        records.append(
            {
                **per_text[first][index],
                "output_rel_error": max(errors.values()),
                **{f"output_rel_error_{name}": value for name, value in errors.items()},
                "fit_error_before": fitted.error_before,
                "fit_error_after": fitted.error_after,
                "loss_before": fitted.loss_before,
                "loss_after": fitted.loss_after,
                "parameters": fitted.parameters,
                "fit_seconds": fitted.seconds,
                **({k: allocation[index][k] for k in ("window", "heavy_keys", "num_features")} if allocation else {}),
            }
        )
    flats = [e.flat() for e in embeddings]
    cosine = sum(e.sentence_mean for e in embeddings) / len(embeddings)
    summary = {
        "summary": True,
        "model": str(args.model),
        "estimator": args.estimator,
        "options": {k: v for k, v in options.items()},
        "eval_texts": list(eval_texts),
        "fit_texts": str(args.fit_texts),
        "held_out_overlap": overlaps,
        "max_output_rel_error": max(r["output_rel_error"] for r in records),
        "mean_output_rel_error": sum(r["output_rel_error"] for r in records) / len(records),
        "passage512_mean": _worst(f.get("passage512_mean") for f in flats),
        "passage512_min": _worst(f.get("passage512_min") for f in flats),
        "passage128_mean": _worst(f.get("passage128_mean") for f in flats),
        "passage128_min": _worst(f.get("passage128_min") for f in flats),
        "nn_agreement": _worst(f["nn_agreement"] for f in flats),
        "spearman": _worst(f["spearman"] for f in flats),
        "embedding_cosine": cosine,
        "embeddings": flats,
        "sentences": sum(e.sentences for e in embeddings),
        "fit_seconds": fit_seconds,
        "layer_fit_seconds": report.seconds,
        "e2e_seconds": e2e.seconds if e2e else 0.0,
        "e2e_steps": args.e2e_steps,
        "allocation": [
            {k: a[k] for k in ("layer", "window", "heavy_keys", "num_features", "budget")} for a in allocation or []
        ],
        "e2e_loss_before": e2e.loss_before if e2e else None,
        "e2e_loss_after": e2e.loss_after if e2e else None,
        "e2e_best_step": e2e.best_step if e2e else None,
        "lora_rank": args.lora_rank,
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
            f"{args.estimator} {options} on {args.model}: attention-output relative error on {', '.join(eval_texts)} "
            "(the largest of the texts)",
            table(records, COLUMNS),
            "",
            "embedding cosine to the original (mean / min; count)",
            table([_bucket_row(f) for f in flats], BUCKET_COLUMNS),
            "",
            f"max output_rel_error   {summary['max_output_rel_error']:.4f}",
            f"passage512 (headline)  mean {summary['passage512_mean']:.4f}  min {summary['passage512_min']:.4f}"
            "  (worst text)",
            f"nn_agreement@1         {summary['nn_agreement']:.3f}  spearman {summary['spearman']:.4f}  (worst text)",
            f"embedding_cosine       {cosine:.6f}  (sentences, mean pooling)",
            f"fit_seconds            {fit_seconds:.1f}  ({args.steps} steps/layer, loss {args.loss}; "
            f"{args.e2e_steps} end-to-end steps)",
        ]
        text = "\n".join(lines)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")
    return 0


BUCKET_COLUMNS = ("text", "<=25", "26-127", "128-511", "512", "passage128", "passage512", "nn@1", "spearman")


def _fmt(mean: Any, low: Any, count: Any = None) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "-"
    tail = f" ({count})" if count is not None else ""
    return f"{mean:.4f}/{low:.4f}{tail}"


def _bucket_row(flat: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"text": flat["text"]}
    for bucket, key in (("<=25", "le25"), ("26-127", "26_127"), ("128-511", "128_511"), ("512", "512")):
        row[bucket] = _fmt(flat[f"cos_{key}_mean"], flat[f"cos_{key}_min"], flat[f"cos_{key}_count"])
    for length in ("128", "512"):
        row[f"passage{length}"] = _fmt(flat.get(f"passage{length}_mean"), flat.get(f"passage{length}_min"))
    row["nn@1"] = f"{flat['nn_agreement']:.3f}"
    row["spearman"] = f"{flat['spearman']:.4f}"
    return row
