"""Does the per-layer fit of a MiniLM conversion overfit a small corpus? (issue #28)

Fits chosen layers of the documented ``sliding-window`` conversion (window +-24, one
global token, 78 hedgehog features) on the first half of the shipped prose (paragraphs
1-18, about 1,400 words, 4 sequences of 512 tokens) and reports each layer's attention-
output relative error in sample, on the prose's second half (the same genre, never
fitted) and on two held-out genres (``held-out``: standard-library documentation,
``legal``: a contract; 4 sequences of 512 tokens each). Variants change one thing of the
fit at a time::

    python scripts/fit_generalisation.py --layers 4 5 --variants steps=600 steps=1200 \\
        passages=32 anchor=1e-5 anchor=1e-4 rows=256

``steps`` (Adam steps per layer, default 600), ``rows`` (query rows per step, 96),
``lr`` (0.02), ``passages=K`` (fit on K passages cut at random offsets of the same half
instead of its 4 packed sequences) and ``anchor=L`` (an L2-SP pull
:math:`L \\sum \\lVert\\theta - \\theta_0\\rVert^2` towards the starting parameters added to
every step's loss, as the end-to-end stage's ``--anchor`` does). One JSON line per
(variant, layer). Results and what they mean: ``docs/real_models.rst`` (fit-corpus).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

OPTIONS = {"window": 24, "num_features": 78, "global_tokens": 1, "activation": "exp"}


def parse_variant(text: str) -> dict[str, Any]:
    """``"steps=1200"`` -> ``{"steps": 1200}`` (several joined by ``:``)."""
    out: dict[str, Any] = {"steps": 600, "rows": 96, "lr": 0.02, "passages": 0, "anchor": 0.0}
    for part in text.split(":"):
        key, _, value = part.partition("=")
        if key not in out:
            raise SystemExit(f"--variants: unknown setting {key!r} in {text!r} (expected {sorted(out)})")
        out[key] = type(out[key])(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 5])
    parser.add_argument("--variants", nargs="+", default=["steps=600"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import kernelattn_core as ka
    from kernelattn_core.convert import distill
    from kernelattn_core.convert.attention import converted_modules
    from kernelattn_core.workloads import minilm

    teacher, tokenizer = minilm.load_model("minilm")
    paragraphs = minilm.read_texts("shipped").split("\n\n")
    first, second = "\n\n".join(paragraphs[:18]), "\n\n".join(paragraphs[18:])
    checks = {"prose, 2nd half": second, "held-out": minilm.read_texts("held-out"), "legal": minilm.read_texts("legal")}
    # the judged layers' inputs are the teacher's (the student's projections are its own), so
    # one capture serves every variant
    probe = ka.convert_attention(teacher, "sliding-window", **OPTIONS)
    judged = {
        name: distill.capture_layers(probe, teacher, [minilm.pack(tokenizer, t, max_length=512, max_sequences=4)])
        for name, t in checks.items()
    }

    for text in args.variants:
        v = parse_variant(text)
        torch.manual_seed(0)
        student = ka.convert_attention(teacher, "sliding-window", **OPTIONS)
        modules = dict(converted_modules(student))
        names = list(modules)
        if v["passages"]:
            fit = minilm.random_passages(tokenizer, first, length=512, count=v["passages"], seed=0)
        else:
            fit = minilm.pack(tokenizer, first, max_length=512)
        fitted = distill.capture_layers(student, teacher, [fit])
        gen = torch.Generator().manual_seed(0)
        for index in args.layers:
            est = modules[names[index]].estimator.eval()
            t0 = time.perf_counter()
            distill._fit_layer(
                est,
                fitted[names[index]],
                steps=v["steps"],
                lr=v["lr"],
                loss="ce",
                rows=v["rows"],
                gen=gen,
                anchor=v["anchor"],
            )
            record = {
                "variant": text,
                "layer": index,
                "fit_sequences": int(fit["input_ids"].shape[0]),
                "seconds": round(time.perf_counter() - t0, 1),
                "in_sample": round(distill._evaluate(est, fitted[names[index]], "ce")[1], 3),
            }
            for name, layers in judged.items():
                record[name] = round(distill._evaluate(est, layers[names[index]], "ce")[1], 3)
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
