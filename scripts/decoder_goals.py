"""Measure the goals of the decoder work (issue #24) on this machine.

Three measurements, each printing one JSON record per line (and writing them with
``--json FILE``). Timing figures need a quiet machine: run one at a time, nothing else
running, and say which machine gave them.

``decode``
    Tokens per second of greedy decoding at a given context length and the bytes of the
    decoding cache, for the original model (softmax attention, ``sdpa``, its key-value
    ``DynamicCache``) and for the converted model (``prf``, ``hedgehog``, ``sliding-window``
    on their constant-size states). The model is the teacher's architecture (GPT-2, width
    256, 4 layers, 4 heads, byte vocabulary) with random weights and positions up to the
    longest context: speed and memory do not depend on the weights. Each context is
    prefilled once, then ``--tokens`` tokens are decoded one by one. Each converted model's
    ``speedup`` is over the original measured just before it; ``--repeats R`` runs it all
    R times and ends with the medians (the original's speed at a long context follows the
    machine's memory bandwidth, which can swing from one minute to the next).

``compile``
    One training step (forward, backward, Adam) of a small causal LM built from
    :class:`~kernelattn_core.KernelAttention` (``prf``, ``hedgehog``): eager, the first
    compiled step (``torch.compile(fullgraph=True)``, Inductor: the compile time) and the
    compiled steady state, medians of ``--repeats`` steps.

``perplexity``
    Held-out perplexity of a teacher checkpoint and of students converted from it and
    fitted with :func:`~kernelattn_core.distill_attention` on the fitting text, at a
    budget of 128 per query (``sliding-window``: 64 window keys + 64 features;
    ``hedgehog`` and ``prf``: 128 features), optionally followed by the end-to-end stage
    (``--e2e-steps``, ``--lora-rank``: :func:`~kernelattn_core.convert.lm.finetune_causal_lm`
    on the first 90 % of the fitting text, early-stopped on the rest). Any local decoder
    checkpoint works.

``profile``
    Where the time of greedy decoding goes: ``model.generate()`` of ``--tokens`` tokens
    after a ``--context``-token prompt, under :mod:`cProfile`, for each estimator; prints
    the functions with the most cumulative time and their calls per generated token
    (call counts do not depend on the machine's load; the times do).

Examples::

    python scripts/decoder_goals.py decode --contexts 1024 4096 16384 --threads 2
    python scripts/decoder_goals.py decode --contexts 1024 16384 --tokens 64 --repeats 3
    python scripts/decoder_goals.py compile --threads 2
    python scripts/decoder_goals.py profile --context 16384 --tokens 32 --estimators prf hedgehog
    python -m kernelattn_core.convert.teacher --output teacher --minutes 10
    python scripts/decoder_goals.py perplexity teacher --steps 300
    python scripts/decoder_goals.py perplexity teacher --steps 300 --e2e-steps 200 --lora-rank 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

STUDENTS: dict[str, dict[str, Any]] = {
    "sliding-window": {"window": 64, "num_features": 64},
    "hedgehog": {"num_features": 128},
    "prf": {"num_features": 128, "seed": 0},
}


def emit(record: dict[str, Any], sink: list[dict[str, Any]]) -> None:
    sink.append(record)
    print(json.dumps(record), flush=True)


# ---------------------------------------------------------------------- decode
def decode_model(max_context: int) -> Any:
    import transformers

    from kernelattn_core.convert.teacher import SIZES

    torch.manual_seed(0)
    sizes = dict(SIZES["small"], n_positions=max_context + 64)
    config = transformers.GPT2Config(vocab_size=384, bos_token_id=1, eos_token_id=1, pad_token_id=0, **sizes)
    config._attn_implementation = "sdpa"
    return transformers.GPT2LMHeadModel(config).eval()


@torch.no_grad()
def time_decoding(model: Any, context: int, tokens: int, cache: Any) -> dict[str, float]:
    ids = torch.randint(3, 384, (1, context), generator=torch.Generator().manual_seed(context))
    t0 = time.perf_counter()
    out = model(input_ids=ids, cache=cache, use_cache=True)
    prefill = time.perf_counter() - t0
    cache = out.cache
    nxt = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        nxt = out.logits[:, -1:].argmax(-1)
    if hasattr(cache, "nbytes"):
        size = cache.nbytes()
    else:
        size = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    return {"prefill_s": prefill, "tokens_per_s": 1.0 / statistics.median(times), "cache_bytes": size}


ORIGINAL = "softmax (original, KV cache)"


def run_decode(args: argparse.Namespace, sink: list[dict[str, Any]]) -> None:
    """Each context, each model in turn (the original first), ``--repeats`` times over.
    Every record carries its ``repeat`` and, for a converted model, ``speedup``: its
    tokens per second over the original's in the same repeat (measured seconds apart, so
    the machine's state of the moment reaches both). With several repeats a ``decode
    summary`` record per model and context follows: the medians of the tokens per second
    and of the speed-ups, and the smallest and largest speed-up."""
    import kernelattn_core as ka
    from kernelattn_core.convert import KernelCache

    base = decode_model(max(args.contexts))
    models = {ORIGINAL: base}
    for name in args.estimators:
        models[name] = ka.convert_attention(base, name, **STUDENTS[name]).eval()
    repeats = getattr(args, "repeats", 1)
    records = []
    for repeat in range(repeats):
        for context in args.contexts:
            original = None
            for label, model in models.items():
                cache = None if model is base else KernelCache()
                result = time_decoding(model, context, args.tokens, cache)
                record = {"measure": "decode", "model": label, "context": context, "repeat": repeat, **result}
                if model is base:
                    original = result["tokens_per_s"]
                else:
                    record["speedup"] = result["tokens_per_s"] / original
                records.append(record)
                emit(record, sink)
    if repeats > 1:
        for context in args.contexts:
            for label in models:
                rows = [r for r in records if r["model"] == label and r["context"] == context]
                summary = {
                    "measure": "decode summary",
                    "model": label,
                    "context": context,
                    "repeats": repeats,
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
                    "cache_bytes": rows[-1]["cache_bytes"],
                }
                if label != ORIGINAL:
                    ups = [r["speedup"] for r in rows]
                    summary |= {"speedup": statistics.median(ups), "speedup_min": min(ups), "speedup_max": max(ups)}
                emit(summary, sink)


# ---------------------------------------------------------------------- profile
def run_profile(args: argparse.Namespace, sink: list[dict[str, Any]]) -> None:
    import cProfile
    import io
    import pstats

    import kernelattn_core as ka
    from kernelattn_core.convert import KernelCache

    base = decode_model(args.context + args.tokens + 8)
    ids = torch.randint(3, 384, (1, args.context), generator=torch.Generator().manual_seed(0))
    for name in args.estimators:
        model = ka.convert_attention(base, name, **STUDENTS[name]).eval()
        with torch.no_grad():
            cache = KernelCache()
            out = model(input_ids=ids, cache=cache, use_cache=True)  # the prefill, outside the profile
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.ones(1, args.context + 1, dtype=torch.long)
            prof = cProfile.Profile()
            prof.enable()
            model.generate(
                torch.cat([ids, nxt], 1), attention_mask=mask, cache=cache, max_new_tokens=args.tokens,
                do_sample=False, min_new_tokens=args.tokens,
            )  # fmt: skip
            prof.disable()
        stats = pstats.Stats(prof)
        rows = []
        for (file, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
            rows.append(
                {
                    "function": f"{'/'.join(file.rsplit('/', 2)[-2:])}:{line}({func})",
                    "calls_per_token": calls / args.tokens,
                    "tottime_s": tottime,
                    "cumtime_s": cumtime,
                }
            )
        rows.sort(key=lambda r: -r["cumtime_s"])
        total = max(r["cumtime_s"] for r in rows)
        for r in rows[: args.top]:
            emit(
                {"measure": "profile", "model": name, "context": args.context, **r, "share": r["cumtime_s"] / total},
                sink,
            )
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
        print(text.getvalue(), file=sys.stderr)


# ---------------------------------------------------------------------- compile
#: ``compile --estimators none``: the model with each attention replaced by one linear map
#: (the part of the step that compiling cannot make faster: the dense layers)
NO_ATTENTION = "none"


class _Linear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return super().forward(x), None


class _Block(torch.nn.Module):
    def __init__(self, width: int, heads: int, name: str, options: dict[str, Any]) -> None:
        import kernelattn_core as ka

        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        if name == NO_ATTENTION:
            self.attn: torch.nn.Module = _Linear(width, width)
        else:
            self.attn = ka.KernelAttention(width, heads, name, causal=True, batch_first=True, **options)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    """Token and position embeddings, ``depth`` blocks of kernelized attention, a tied head."""

    def __init__(self, name: str, options: dict[str, Any], vocab: int = 384, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.embed, self.pos = torch.nn.Embedding(vocab, width), torch.nn.Embedding(1024, width)
        self.blocks = torch.nn.ModuleList(_Block(width, 4, name, options) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.embed.weight.T
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def run_compile(args: argparse.Namespace, sink: list[dict[str, Any]]) -> None:
    """Eager against compiled training steps of one model per estimator: both built and
    given their first step (the compiled one's includes the compilation), then timed in
    turn, one eager step and one compiled step per repeat, so that a change of the
    machine's speed during the run reaches both medians alike."""
    for name in args.estimators:
        options = {k: v for k, v in STUDENTS.get(name, {}).items() if k != "window"}
        ids = torch.randint(0, 384, (args.batch, args.length), generator=torch.Generator().manual_seed(0))
        record: dict[str, Any] = {"measure": "compile", "estimator": name, "batch": args.batch, "length": args.length}
        steps = {}
        for mode in ("eager", "compiled"):
            torch.manual_seed(0)
            model = TinyLM(name, options).train()
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            run = torch.compile(model, fullgraph=True) if mode == "compiled" else model

            def step(run: Any = run, opt: Any = opt, ids: torch.Tensor = ids) -> float:
                t0 = time.perf_counter()
                loss = run(ids)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                return time.perf_counter() - t0

            steps[mode] = step
            record[f"{mode}_first_s"] = step()
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.repeats):
            for mode, step in steps.items():
                times[mode].append(step())
        for mode, ts in times.items():
            record[f"{mode}_step_s"] = statistics.median(ts)
        record["compiled_over_eager"] = record["compiled_step_s"] / record["eager_step_s"]
        emit(record, sink)
        torch._dynamo.reset()


# ---------------------------------------------------------------------- perplexity
def run_perplexity(args: argparse.Namespace, sink: list[dict[str, Any]]) -> None:
    import kernelattn_core as ka
    from kernelattn_core.convert import lm
    from kernelattn_core.workloads import minilm

    teacher, tokenizer = lm.load_decoder(args.checkpoint)
    held_out = lm.pack_causal(tokenizer, minilm.read_texts(args.eval_texts), max_length=args.max_length)
    fit = lm.pack_causal(
        tokenizer, minilm.read_texts(args.fit_texts), max_length=args.max_length, max_sequences=args.fit_sequences
    )
    if args.e2e_steps:  # trained on the first 90 % of the fitting text, early-stopped on the rest
        from kernelattn_core.cli.convert_decoder import _fitting_split

        first, rest = _fitting_split(minilm.read_texts(args.fit_texts))
        e2e_train = lm.pack_causal(tokenizer, first, max_length=args.max_length)
        e2e_check = lm.pack_causal(tokenizer, rest, max_length=args.max_length, max_sequences=8)
    base = lm.perplexity(teacher, held_out)
    emit({"measure": "perplexity", "model": "teacher", "held_out_perplexity": base}, sink)
    for name in args.estimators:
        t0 = time.perf_counter()
        student = ka.convert_attention(teacher, name, **STUDENTS[name])
        before = lm.perplexity(student, held_out)
        report = ka.distill_attention(student, teacher, [fit], steps=args.steps, lr=args.lr, rows=128, progress=False)
        after = lm.perplexity(student, held_out)
        e2e: dict[str, Any] = {}
        if args.e2e_steps:  # stage 2 (Hedgehog / LoLCATs): the whole model on the teacher's next-token distribution
            tuned = lm.finetune_causal_lm(
                student, teacher, e2e_train, validation=e2e_check, steps=args.e2e_steps, lr=args.e2e_lr,
                lora_rank=args.lora_rank, progress=False,
            )  # fmt: skip
            e2e = {
                "held_out_perplexity_stage1": after,
                "e2e_steps": args.e2e_steps,
                "lora_rank": args.lora_rank,
                "e2e_best_step": tuned.best_step,
                "e2e_seconds": tuned.seconds,
            }
            after = lm.perplexity(student, held_out)
        emit(
            {
                "measure": "perplexity",
                "model": name,
                "options": STUDENTS[name],
                "held_out_perplexity_unfitted": before,
                "held_out_perplexity": after,
                "over_teacher": after / base,
                "fit_steps": args.steps,
                "fit_seconds": report.seconds,
                "seconds": time.perf_counter() - t0,
                **e2e,
            },
            sink,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the goals are for 2 cores)")
    parser.add_argument("--json", help="also write the records to this file")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("decode")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--estimators", nargs="+", default=list(STUDENTS))
    p.add_argument("--repeats", type=int, default=1, help="measure everything this many times (medians at the end)")
    p = sub.add_parser("profile")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--estimators", nargs="+", default=["prf", "hedgehog"])
    p = sub.add_parser("compile")
    p.add_argument("--estimators", nargs="+", default=["prf", "hedgehog"], help=f"registry names, or {NO_ATTENTION!r}")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p = sub.add_parser("perplexity")
    p.add_argument("checkpoint", help="a local decoder folder (with its tokenizer)")
    p.add_argument("--estimators", nargs="+", default=list(STUDENTS))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--fit-sequences", type=int, default=None)
    p.add_argument("--fit-texts", default="fitting")
    p.add_argument("--e2e-steps", type=int, default=0, help="end-to-end steps after the per-layer fit")
    p.add_argument("--e2e-lr", type=float, default=1e-3)
    p.add_argument("--lora-rank", type=int, default=0, help="q/k/v adapters of the end-to-end stage (0: none)")
    p.add_argument("--eval-texts", default="held-out")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sink: list[dict[str, Any]] = []
    {"decode": run_decode, "profile": run_profile, "compile": run_compile, "perplexity": run_perplexity}[args.what](
        args, sink
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write("\n".join(json.dumps(r) for r in sink) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
