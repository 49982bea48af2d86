"""``kernelattn experiment lara-efficiency``: Table 6 of the paper at CPU scale.

Time and peak tensor memory of a forward pass of a transformer encoder (8 layers,
embedding 192, 3 heads, FFN 4 x 192, batch 1, training mode under ``no_grad``, so
every estimator draws its samples) against sequence length, for softmax attention,
Performer-style PRF (16 features), LARA (16 landmarks) and RA (S = 1), printed as
ratios to softmax in one run.

``softmax`` is softmax attention as the paper measures it, with the ``N x M`` weight
matrix materialised (the core's naive exact path); ``sdpa`` adds torch's fused
``scaled_dot_product_attention``, whose memory is linear in the length, as the
baseline people use today.

Two memory figures: ``peak_mb`` of the whole encoder's forward and ``attn_peak_mb`` of one
attention call alone (``[1, heads, N, embed / heads]``). Where attention is linear, the
whole stack's peak is set by the layers around it (the feed-forward block's
``[N, 4 embed]`` activation), so Performer, LARA and SDPA share one ``peak_mb``; the
attention figure shows what the paper's Table 6 compares (LARA a little above Performer).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from kernelattn_core import ExactAttention, create

METHODS: dict[str, Callable[[int], Any]] = {
    "softmax": lambda s: ExactAttention(backend="naive"),
    "sdpa": lambda s: create("softmax"),
    "performer": lambda s: create("prf", num_features=s, redraw_every=1),
    "lara": lambda s: create("lara", num_features=s),
    "ra": lambda s: create("ra", num_features=1),
}


@dataclass
class EfficiencyConfig:
    """Settings of the efficiency experiment (the paper's by default)."""

    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 3072, 4096, 8192])
    layers: int = 8
    embed: int = 192
    heads: int = 3
    samples: int = 16
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    repeats: int = 3
    warmup: int = 1
    seed: int = 0


class EncoderLayer(nn.Module):
    """Pre-norm transformer encoder layer around any attention estimator."""

    def __init__(self, embed: int, heads: int, attention: nn.Module) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(embed), nn.LayerNorm(embed)
        self.qkv, self.out = nn.Linear(embed, 3 * embed), nn.Linear(embed, embed)
        self.ffn = nn.Sequential(nn.Linear(embed, 4 * embed), nn.GELU(), nn.Linear(4 * embed, embed))
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        att = self.attention(qkv[0], qkv[1], qkv[2])  # [B, H, N, d]
        x = x + self.out(att.transpose(1, 2).reshape(b, n, e))
        return x + self.ffn(self.norm2(x))


def make_model(method: str, config: EfficiencyConfig) -> nn.Module:
    """The encoder stack with ``method`` attention in every layer."""
    layers = [EncoderLayer(config.embed, config.heads, METHODS[method](config.samples)) for _ in range(config.layers)]
    return nn.Sequential(*layers)


def run_experiment(config: EfficiencyConfig) -> list[dict[str, Any]]:
    """One record per (method, length): milliseconds, MB and ratios to softmax."""
    from kernelattn_core.toolkit import median_time, peak_memory

    device = torch.device("cpu")
    records: list[dict[str, Any]] = []
    for n in config.lengths:
        base: dict[str, float] = {}
        for method in config.methods:
            torch.manual_seed(config.seed)
            model = make_model(method, config).train()
            x = torch.randn(1, n, config.embed)

            def call(model: nn.Module = model, x: torch.Tensor = x) -> torch.Tensor:
                with torch.no_grad():
                    return model(x)

            seconds = median_time(call, device, repeats=config.repeats, warmup=config.warmup)
            mem = peak_memory(call, device)
            attn_mem = peak_memory(_attention_call(method, config, n), device)
            if method == "softmax" or not base:
                base = {"time": seconds, "mem": mem, "attn_mem": attn_mem}
            records.append(
                {
                    "method": method,
                    "length": n,
                    "time_ms": round(seconds * 1e3, 2),
                    "time_ratio": round(seconds / base["time"], 2),
                    "peak_mb": round(mem / 2**20, 2),
                    "mem_ratio": round(mem / base["mem"], 2),
                    "attn_peak_mb": round(attn_mem / 2**20, 3),
                    "attn_mem_ratio": round(attn_mem / base["attn_mem"], 3),
                }
            )
    return records


def _attention_call(method: str, config: EfficiencyConfig, n: int) -> Callable[[], torch.Tensor]:
    """One attention call of ``method`` (training mode, no grad, as in the stack) on
    ``q, k, v [1, heads, n, embed / heads]``, for its peak memory alone."""
    torch.manual_seed(config.seed)
    attention = METHODS[method](config.samples).train()
    q, k, v = (torch.randn(1, config.heads, n, config.embed // config.heads) for _ in range(3))

    def call() -> torch.Tensor:
        with torch.no_grad():
            return attention(q, k, v)

    return call


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = EfficiencyConfig()
    parser.add_argument("--lengths", type=int, nargs="+", default=d.lengths, help="sequence lengths")
    parser.add_argument("--layers", type=int, default=d.layers, help="encoder layers (8)")
    parser.add_argument("--embed", type=int, default=d.embed, help="embedding width (192)")
    parser.add_argument("--heads", type=int, default=d.heads, help="attention heads (3)")
    parser.add_argument("--samples", type=int, default=d.samples, help="PRF features / LARA landmarks (16)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=d.methods)
    parser.add_argument(
        "--repeats", type=int, default=d.repeats, help="timed forward calls, at least (median of blocked_autorange)"
    )
    parser.add_argument("--warmup", type=int, default=d.warmup, help="untimed forward calls first")
    parser.add_argument("--seed", type=int, default=d.seed)
    from kernelattn_core.toolkit import add_output_arguments

    add_output_arguments(parser)


def figure(records: list[dict[str, Any]], path: object) -> None:
    """Table 6 as bars: time and peak-memory ratios to softmax, grouped by length."""
    from kernelattn_core.toolkit import grouped_bars

    grouped_bars(
        records,
        path,  # type: ignore[arg-type]
        x="length",
        group="method",
        values=(("time_ratio", "time / softmax"), ("mem_ratio", "peak memory / softmax")),
        title="LARA efficiency (Table 6 at CPU scale)",
    )


def run(args: argparse.Namespace) -> int:
    """Run and write the table (ratios to softmax, as in Table 6), CSV / JSON, and the figure."""
    from kernelattn_core.toolkit import check_plot, write_results

    check_plot(args)
    fields = EfficiencyConfig.__dataclass_fields__
    config = EfficiencyConfig(**{k: getattr(args, k) for k in fields if hasattr(args, k)})
    if "softmax" in config.methods:
        config.methods = ["softmax"] + [m for m in config.methods if m != "softmax"]
    records = run_experiment(config)
    title = (
        f"LARA efficiency (Table 6 at CPU scale): {config.layers} layers, embedding {config.embed}, "
        f"{config.heads} heads, {config.samples} samples/landmarks (RA: S = 1), batch 1, forward, "
        f"median of {config.repeats}; ratios to {config.methods[0]}"
    )
    write_results(
        args,
        records,
        list(records[0]),
        title=title,
        json_payload={"config": asdict(config), "records": records},
        figure=figure,
    )
    return 0


def _make_experiment():  # type: ignore[no-untyped-def]
    from kernelattn_core.toolkit import Experiment

    return Experiment(
        name="lara-efficiency",
        help="LARA Table 6 at CPU scale: time and peak memory of softmax, Performer, LARA and RA vs length",
        add_arguments=add_arguments,
        run=run,
    )


LARA_EFFICIENCY = _make_experiment()
