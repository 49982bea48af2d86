"""``kernelattn convert`` for a local decoder language model: fit, held-out perplexity, save.

A model folder whose ``config.json`` names a causal language model (an architecture
``...ForCausalLM`` or ``...LMHeadModel``: GPT-2, Llama, Mistral, Qwen2, the project's
byte-level teacher of :mod:`kernelattn_core.convert.teacher`) is

1. loaded with its tokenizer (:func:`kernelattn_core.convert.lm.load_decoder`) and
   converted (:func:`~kernelattn_core.convert_attention`: rotary embedding applied before
   the estimator, grouped-query heads repeated, causal plus padding masks);
2. fitted layer by layer to its own softmax attention on the fitting text
   (:func:`~kernelattn_core.distill_attention`, ``--steps``), the text packed into
   sequences of ``--max-length`` tokens (:func:`~kernelattn_core.convert.lm.pack_causal`);
3. optionally tuned end to end on the next-token distribution of the original
   (:func:`~kernelattn_core.convert.lm.finetune_causal_lm`, ``--e2e-steps``, with low-rank
   adapters of the query/key/value projections with ``--lora-rank``), early-stopped on
   the last tenth of the fitting text, never on an evaluation text;
4. reported: per layer the attention fit, and per evaluation text the next-token
   perplexity of the original and of the converted model on the same tokens, with their
   ratio (the headline is the largest ratio over the texts).

``--save DIR`` writes ``save_pretrained`` output with the tokenizer, which
:func:`kernelattn_core.convert.from_pretrained` (and ``lm.load_decoder``) reloads.
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
from ..report.output import table, to_json
from .convert_shared import _stage

#: model types whose ``config.json`` is a causal LM even without an ``architectures`` entry
DECODER_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt_neox")
#: encoder families: a causal-LM head on them (``BertLMHeadModel``) is not a decoder here
ENCODER_TYPES = ("bert", "roberta", "distilbert", "xlm-roberta", "camembert", "electra", "mpnet", "deberta")

LAYER_COLUMNS = ("layer", "name", "fit_error_before", "fit_error_after", "fit_seconds")
TEXT_COLUMNS = ("text", "sequences", "tokens", "teacher_perplexity", "student_perplexity", "ratio")


def is_decoder_config(config: dict[str, Any]) -> bool:
    """Whether a ``config.json`` (read as a dict) describes a causal decoder LM."""
    model_type = str(config.get("model_type", "")).lower()
    if model_type in ENCODER_TYPES or config.get("is_encoder_decoder"):
        return False
    archs = config.get("architectures") or []
    if any(isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return True
    return model_type in DECODER_TYPES


def _first(config: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _check_save_dir(path: str | None) -> None:
    """``--save`` of a decoder: a folder (made if missing) in a folder that exists."""
    if path is None:
        return
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise InputError(f"--save: a decoder is saved into a folder (save_pretrained), got the file {path!r}")
    parent = target if target.is_dir() else (target.parent if str(target.parent) else Path("."))
    if not parent.is_dir():
        raise InputError(f"--save: the folder {str(parent)!r} of {path!r} does not exist (create it first)")
    if not os.access(parent, os.W_OK):
        raise InputError(f"--save: the folder {str(parent)!r} is not writable")


def validate(
    args: argparse.Namespace, options: dict[str, Any], device: Any, path: Path, config: dict[str, Any]
) -> dict[str, Any]:
    """The decoder part of :func:`kernelattn_core.cli.convert_cmd.validate` (called once the
    folder's config is known to be a decoder's): encoder-only options are refused, the
    lengths checked against the model's positions, the estimator built once. Sets
    ``args.max_length`` (default: the ``context`` of the folder's ``teacher.json``, else
    256, capped at the model's positions) and ``args.eval_sequences`` (default: all)."""
    from ..convert.attention import _check_options
    from ..module import build_estimator
    from .convert_shared import ENCODER_ONLY, _check_output_path, _read_texts

    arch = (config.get("architectures") or [config.get("model_type")])[0]
    for flag in ENCODER_ONLY:
        if flag in (getattr(args, "given", None) or ()):
            raise InputError(
                f"{flag}: an encoder option (sentence embeddings, window allocation, encoder end-to-end passages); "
                f"{str(path)!r} is a decoder ({arch}), reported by held-out perplexity: leave {flag} out"
            )
    if "kernelattn" in config:
        raise InputError(
            f"MODEL_DIR: {str(path)!r} holds a model converted already ({config['kernelattn'].get('estimator')!r}); "
            "convert the original checkpoint (kernelattn_core.convert.from_pretrained loads this one)"
        )
    if not any((path / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        raise InputError(
            f"MODEL_DIR: {str(path)!r} has no tokenizer (tokenizer_config.json or tokenizer.json); save the "
            "tokenizer with the model (tokenizer.save_pretrained(folder))"
        )
    positions = _first(config, "n_positions", "max_position_embeddings", "n_ctx")
    if args.max_length is None:
        context = None
        record = path / "teacher.json"
        if record.is_file():
            try:
                context = json.loads(record.read_text("utf-8")).get("context")
            except (OSError, ValueError, AttributeError):
                context = None
        args.max_length = context if isinstance(context, int) and context >= 3 else 256
        if positions is not None:
            args.max_length = min(args.max_length, positions)
    if positions is not None and args.max_length > positions:
        raise InputError(f"--max-length: the model takes at most {positions} positions, got {args.max_length}")
    _check_output_path("--output", args.output)
    _check_save_dir(args.save)
    _check_options(args.estimator, options)
    heads = _first(config, "num_attention_heads", "n_head")
    width = _first(config, "hidden_size", "n_embd")
    head_dim = _first(config, "head_dim")
    if head_dim is None and heads and width and width % heads == 0:
        head_dim = width // heads
    if heads and head_dim:
        try:  # the options, as the first converted layer will build them
            est = build_estimator(args.estimator, head_dim, heads, options)
        except TypeError as exc:
            from .convert_shared import _one_line

            raise InputError(f"--option: {_one_line(exc)}") from None
        if not getattr(est, "supports_causal", True):
            raise InputError(
                f"--estimator: {args.estimator!r} is non-causal only; a decoder's self-attention is causal "
                "(choose an estimator with causal support: kernelattn plugins lists the flags)"
            )
    fit_text = _read_texts("--fit-texts", args.fit_texts)
    eval_texts = {source: _read_texts("--eval-texts", source) for source in args.eval_texts}
    return {
        "decoder": True,
        "architecture": arch,
        "options": options,
        "device": device,
        "model": path,
        "fit_text": fit_text,
        "eval_texts": eval_texts,
    }


def _fitting_split(fit_text: str, share: float = 0.9) -> tuple[str, str]:
    """The fitting text cut at a line break near ``share`` of its length: the first part
    trains the end-to-end stage, the last part early-stops it."""
    cut = fit_text.rfind("\n", 0, int(len(fit_text) * share))
    cut = cut if cut > 0 else int(len(fit_text) * share)
    return fit_text[:cut], fit_text[cut:]


def run(args: argparse.Namespace, checked: dict[str, Any]) -> int:
    """Convert, fit and report a decoder (module docstring)."""
    import torch

    from ..convert import convert_attention, distill_attention, lm
    from ..report.progress import progress_wanted
    from ..workloads import minilm
    from .convert_shared import _one_line, _share

    options, device, path = checked["options"], checked["device"], checked["model"]
    fit_text, eval_texts = checked["fit_text"], checked["eval_texts"]
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    talk = progress_wanted(sys.stderr, not args.no_progress)
    progress = None if not args.no_progress else False
    torch.manual_seed(args.seed)
    _stage(f"loading the decoder {str(path)!r} ({checked['architecture']})", talk)
    try:
        teacher, tokenizer = lm.load_decoder(path, dtype=dtype)
    except KernelAttnError:
        raise
    except Exception as exc:  # a folder transformers cannot read: one line, not its traceback
        raise InputError(f"MODEL_DIR: cannot load {str(path)!r}: {_one_line(exc)}") from None
    teacher = teacher.to(device).eval()
    student = convert_attention(teacher, args.estimator, **options)
    overlaps = {name: minilm.overlap(text, fit_text) for name, text in eval_texts.items()}
    for name, share in overlaps.items():
        if share > 0:
            sys.stderr.write(
                f"kernelattn: warning: {_share(share)} of the sentences of --eval-texts {name!r} are also in the "
                "fitting text: its perplexities are not wholly held out\n"
            )

    def on_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in batch.items()}

    start = time.perf_counter()
    e2e_text, check_text = _fitting_split(fit_text) if args.e2e_steps else (fit_text, "")
    # with stage 2, the tenth of the fitting text that early-stops it is not fitted in stage 1 either
    fit = on_device(lm.pack_causal(tokenizer, e2e_text, max_length=args.max_length, max_sequences=args.fit_sequences))
    _stage(
        f"stage 1: per-layer attention fit, {args.steps} steps per layer on {fit['input_ids'].shape[0]} sequences "
        f"of {args.max_length} tokens",
        talk and args.steps > 0,
    )
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
        train = on_device(lm.pack_causal(tokenizer, e2e_text, max_length=args.max_length))
        held = on_device(lm.pack_causal(tokenizer, check_text, max_length=args.max_length, max_sequences=8))
        _stage(
            f"stage 2: end-to-end fit on the original's next-token distribution, {args.e2e_steps} steps "
            f"(lora rank {args.lora_rank}), early-stopped on the last tenth of the fitting text",
            talk,
        )
        e2e = lm.finetune_causal_lm(
            student,
            teacher,
            train,
            validation=held,
            steps=args.e2e_steps,
            lr=args.e2e_lr,
            lora_rank=args.lora_rank,
            anchor=args.anchor,
            seed=args.seed,
            progress=progress,
        )
    fit_seconds = time.perf_counter() - start
    student.eval()
    texts: list[dict[str, Any]] = []
    for name, text in eval_texts.items():
        try:
            packed = lm.pack_causal(tokenizer, text, max_length=args.max_length, max_sequences=args.eval_sequences)
        except InputError as exc:
            raise InputError(f"--eval-texts: {name!r}: {exc}") from None
        packed = on_device(packed)
        _stage(f"evaluation: perplexity on {name!r} ({packed['input_ids'].shape[0]} sequences)", talk)
        t_nll, count = lm.negative_log_likelihood(teacher, packed)
        s_nll, _ = lm.negative_log_likelihood(student, packed)
        teacher_ppl, student_ppl = math.exp(t_nll / count), math.exp(s_nll / count)
        texts.append(
            {
                "text": name,
                "sequences": int(packed["input_ids"].shape[0]),
                "tokens": count,
                "teacher_perplexity": teacher_ppl,
                "student_perplexity": student_ppl,
                "ratio": student_ppl / teacher_ppl,
            }
        )
    layers = [
        {
            "layer": fitted.layer,
            "name": fitted.name,
            "fit_error_before": fitted.error_before,
            "fit_error_after": fitted.error_after,
            "loss_before": fitted.loss_before,
            "loss_after": fitted.loss_after,
            "parameters": fitted.parameters,
            "fit_seconds": fitted.seconds,
        }
        for fitted in report.layers
    ]
    summary = {
        "summary": True,
        "model": str(args.model),
        "architecture": checked["architecture"],
        "estimator": args.estimator,
        "options": dict(options),
        "fit_texts": str(args.fit_texts),
        "eval_texts": list(eval_texts),
        "held_out_overlap": overlaps,
        "max_length": args.max_length,
        "teacher_perplexity": texts[0]["teacher_perplexity"],
        "student_perplexity": texts[0]["student_perplexity"],
        "ratio": texts[0]["ratio"],
        "max_ratio": max(t["ratio"] for t in texts),
        "steps": args.steps,
        "loss": args.loss,
        "e2e_steps": args.e2e_steps,
        "lora_rank": args.lora_rank if args.e2e_steps else 0,
        "e2e_loss_before": e2e.loss_before if e2e else None,
        "e2e_loss_after": e2e.loss_after if e2e else None,
        "e2e_best_step": e2e.best_step if e2e else None,
        "fit_seconds": fit_seconds,
        "layer_fit_seconds": report.seconds,
        "e2e_seconds": e2e.seconds if e2e else 0.0,
        "saved": str(args.save) if args.save else None,
    }
    if args.save:
        _stage(f"saving to {args.save!r} (save_pretrained, with the tokenizer)", talk)
        Path(args.save).mkdir(exist_ok=True)
        student.save_pretrained(args.save)
        tokenizer.save_pretrained(args.save)
    if args.format == "json":
        out = to_json([*layers, *texts, summary])
    else:
        rows = [{**t, "ratio": f"{t['ratio']:.4f}"} for t in texts]
        out = "\n".join(
            [
                f"{args.estimator} {options} on {args.model} ({checked['architecture']}): per-layer attention fit "
                f"on the fitting text ({args.fit_texts})",
                table(layers, LAYER_COLUMNS),
                "",
                f"next-token perplexity on the evaluation texts ({args.max_length}-token sequences, the same tokens "
                "for both models)",
                table(rows, TEXT_COLUMNS),
                "",
                f"perplexity ratio       {summary['ratio']:.4f}  ({texts[0]['text']}; student / teacher)",
                f"max ratio              {summary['max_ratio']:.4f}  (worst text)",
                f"fit_seconds            {fit_seconds:.1f}  ({args.steps} steps/layer, loss {args.loss}; "
                f"{args.e2e_steps} end-to-end steps)",
                *([f"saved                  {args.save}"] if args.save else []),
            ]
        )
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(out + "\n")
    else:
        sys.stdout.write(out + "\n")
    return 0
