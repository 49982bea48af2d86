"""Measure launch candidates of the Triton backend on this GPU (``kernelattn_core.engine.triton_config``).

For one shape (``B, H, N, d``, ``D`` PRF features, causal, one dtype) every candidate
configuration — a chunk length ``BT`` and, for all seven kernels alike, the tiles
``(BK, BV, BE)``, warps and pipelining stages — is

1. compiled in parallel worker processes (a small call fills Triton's cache; a candidate
   that cannot be compiled or launched is reported and dropped),
2. run once at full size in this process and checked against the table's current entry
   (relative RMS of the output and of the ``q``, ``k``, ``v`` gradients: the same
   mathematics, so rounding only),
3. timed kernel by kernel (``torch.profiler``, forward + backward) and end to end
   (``triton.testing.do_bench``).

Then the best candidate of each kernel (at the ``BT`` whose composed configuration is
fastest) is composed into one configuration, checked and timed end to end beside the
current entry, flash-linear-attention's ``chunk_linear_attn`` (materialised PRF features,
when installed) and ``scaled_dot_product_attention``. The results go to ``--out``
(JSON) and the summary to stdout::

    python scripts/triton_tune.py --d 128 --features 128 --dtype bfloat16 --seq-len 16384 --out tune.json

Needs a CUDA device (and Triton); nothing of it runs in the test suite.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import sys
import time
from dataclasses import asdict
from typing import Any

import torch

NAMES = ("prep", "state_fwd", "out_fwd", "state_bwd", "bwd_dv", "bwd_dq", "bwd_dk")
#: profiler kernel name -> table names (bwd_dq and bwd_dk are one kernel with SIDE 0 / 1)
KERNEL_OF = {
    "prep_kernel": ("prep",),
    "state_fwd_kernel": ("state_fwd",),
    "out_fwd_kernel": ("out_fwd",),
    "state_bwd_kernel": ("state_bwd",),
    "bwd_dv_kernel": ("bwd_dv",),
    "bwd_dqk_kernel": ("bwd_dq", "bwd_dk"),
}


def candidates(bts: list[int], tiles: list[tuple[int, int, int]], warps: list[int], stages: list[int]) -> list[dict]:
    return [
        {"bt": bt, "tile": list(t), "warps": w, "stages": s}
        for bt, t, w, s in itertools.product(bts, tiles, warps, stages)
    ]


def config_of(cand: dict, per_kernel: dict[str, dict] | None = None):  # type: ignore[no-untyped-def]
    from kernelattn_core.engine import triton_config as C

    def launch(name: str):  # type: ignore[no-untyped-def]
        c = (per_kernel or {}).get(name, cand)
        return C.KernelLaunch(*c["tile"], num_warps=c["warps"], num_stages=c["stages"])

    return C.LaunchConfig(bt=cand["bt"], kernels={n: launch(n) for n in NAMES})


def install(args: argparse.Namespace, cfg) -> None:  # type: ignore[no-untyped-def]
    from kernelattn_core.engine import triton_config as C

    C.TABLE[table_key(args)] = cfg


def table_key(args: argparse.Namespace) -> tuple:
    from kernelattn_core.engine import triton_config as C

    arch = C.arch_of(torch.cuda.get_device_capability()) if args.device == "cuda" else 90
    return C.table_key(arch, args.d, args.features, args.dtype)


def problem(args: argparse.Namespace, n: int, grad: bool = True):  # type: ignore[no-untyped-def]
    import kernelattn_core as ka

    torch.manual_seed(0)
    est = ka.create("prf", num_features=args.features, head_dim=args.d).to(args.device).eval()
    g = torch.Generator(device=args.device).manual_seed(0)
    dtype = getattr(torch, args.dtype)
    qkv = [
        (0.5 * torch.randn(args.batch, args.heads, n, args.d, generator=g, device=args.device))
        .to(dtype)
        .requires_grad_(grad)
        for _ in range(3)
    ]
    return est, qkv


def run(est, qkv, backward: bool = True):  # type: ignore[no-untyped-def]
    import kernelattn_core as ka

    for t in qkv:
        t.grad = None
    out = ka.kernel_attention(*qkv, est, causal=True, backend="triton")
    if backward:
        out.float().square().mean().backward()
    return [out.detach(), *(t.grad for t in qkv)] if backward else [out.detach()]


def _compile_one(payload: tuple[dict, dict]) -> tuple[int, str | None]:
    cand, a = payload
    args = argparse.Namespace(**a)
    try:
        install(args, config_of(cand))
        est, qkv = problem(args, 1024)
        run(est, qkv)
        sync(args)
        return cand["id"], None
    except Exception as exc:  # a candidate that cannot be compiled or launched is reported
        return cand["id"], f"{type(exc).__name__}: {str(exc)[:300]}"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def per_kernel_ms(args: argparse.Namespace, est, qkv) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    run(est, qkv)
    sync(args)
    reps = 3
    with profile(activities=[ProfilerActivity.CUDA if args.device == "cuda" else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            run(est, qkv)
        sync(args)
    times: dict[str, float] = {}
    for evt in prof.key_averages():
        for kname, names in KERNEL_OF.items():
            if evt.key.startswith(kname):
                total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
                times["+".join(names)] = times.get("+".join(names), 0.0) + total / 1e3 / reps
    return times


def e2e_ms(fn, device: str = "cuda") -> float:  # type: ignore[no-untyped-def]
    if device != "cuda":  # a dry run
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=40))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--bt", type=int, nargs="+", default=[64, 128])
    p.add_argument("--tiles", nargs="+", default=["64,64,64", "32,64,64", "64,32,64", "32,32,64", "64,64,32"])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    p.add_argument("--jobs", type=int, default=14)
    p.add_argument("--out", default="tune.json")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script (needs TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("triton_tune: needs a CUDA device", file=sys.stderr)
        return 2
    from kernelattn_core.engine import triton_config as C

    key = table_key(args)
    current = C.TABLE[key]
    tiles = [tuple(int(x) for x in t.split(",")) for t in args.tiles]
    cands = candidates(args.bt, tiles, args.warps, args.stages)  # type: ignore[arg-type]
    for i, c in enumerate(cands):
        c["id"] = i
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.jobs) as pool:
        failed = dict(pool.map(_compile_one, [(c, vars(args)) for c in cands]))
    n_failed = sum(v is not None for v in failed.values())
    print(f"compiled {len(cands)} candidates in {time.time() - t0:.0f} s; {n_failed} failed", flush=True)
    est, qkv = problem(args, args.seq_len)
    C.TABLE[key] = current
    ref = run(est, qkv)
    base_kernels = per_kernel_ms(args, est, qkv)
    base_e2e = e2e_ms(lambda: run(est, qkv), args.device)
    kernels = json.dumps({k: round(v, 3) for k, v in base_kernels.items()})
    print(f"current entry: {base_e2e:.2f} ms fwd+bwd; kernels {kernels}", flush=True)
    results = []
    for c in cands:
        rec: dict[str, Any] = {**c, "error": failed[c["id"]]}
        if rec["error"] is None:
            try:
                install(args, config_of(c))
                got = run(est, qkv)
                rec["rel_err"] = [rel(a, b) for a, b in zip(got, ref)]
                rec["kernels_ms"] = per_kernel_ms(args, est, qkv)
                rec["e2e_ms"] = e2e_ms(lambda: run(est, qkv), args.device)
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        results.append(rec)
        if rec["error"] is None:
            print(
                f"bt={c['bt']} tile={c['tile']} w={c['warps']} s={c['stages']}: {rec['e2e_ms']:.2f} ms, "
                f"err {max(rec['rel_err']):.1e}; " + " ".join(f"{k} {v:.3f}" for k, v in rec["kernels_ms"].items()),
                flush=True,
            )
    ok = [r for r in results if r["error"] is None and max(r["rel_err"]) < 5e-2]
    composed = {}
    for bt in args.bt:
        rows = [r for r in ok if r["bt"] == bt]
        if not rows:
            continue
        best = {}
        for names in KERNEL_OF.values():
            label = "+".join(names)
            win = min(rows, key=lambda r: r["kernels_ms"].get(label, float("inf")))
            for n in names:
                best[n] = {
                    "tile": win["tile"],
                    "warps": win["warps"],
                    "stages": win["stages"],
                    "ms": win["kernels_ms"].get(label),
                }
        install(args, composed_cfg({"kernels": best}, bt))
        got = run(est, qkv)
        composed[bt] = {
            "kernels": best,
            "rel_err": [rel(a, b) for a, b in zip(got, ref)],
            "e2e_ms": e2e_ms(lambda: run(est, qkv), args.device),
            "kernels_ms": per_kernel_ms(args, est, qkv),
        }
        print(f"composed bt={bt}: {composed[bt]['e2e_ms']:.2f} ms, err {max(composed[bt]['rel_err']):.1e}")
    best_bt = min(composed, key=lambda b: composed[b]["e2e_ms"]) if composed else None
    # the composed best beside the current entry, fla and SDPA, forward and forward + backward
    configs = {"current": current}
    if best_bt is not None:
        configs["tuned"] = composed_cfg(composed[best_bt], best_bt)
    anchors = {str(n): anchor_row(args, n, key, configs) for n in sorted({args.seq_len, *args_lengths(args)})}
    C.TABLE[key] = current
    with open(args.out, "w") as f:
        json.dump(
            {
                "gpu": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                "args": {k: v for k, v in vars(args).items()},
                "current": {"bt": current.bt, "kernels": {n: asdict(k) for n, k in current.kernels.items()}},
                "current_kernels_ms": base_kernels,
                "current_e2e_ms": base_e2e,
                "candidates": results,
                "composed": composed,
                "best_bt": best_bt,
                "anchors": anchors,
            },
            f,
            indent=1,
        )
    return 0


def anchor_row(args: argparse.Namespace, n: int, key: tuple, configs: dict) -> dict[str, float]:
    """Forward and forward + backward times at length ``n``: each configuration of
    ``configs``, SDPA, and fla's ``chunk_linear_attn`` fed materialised PRF features."""
    from kernelattn_core.engine import triton_config as C

    est, qkv = problem(args, n)
    q, k, v = qkv
    row: dict[str, float] = {}
    for label, cfg in configs.items():
        C.TABLE[key] = cfg
        row[f"{label} fwd"] = e2e_ms(lambda: run(est, qkv, backward=False), args.device)
        row[f"{label} fwd+bwd"] = e2e_ms(lambda: run(est, qkv), args.device)

    def sdpa(backward: bool) -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            out.float().square().mean().backward()

    row["sdpa fwd"] = e2e_ms(lambda: sdpa(False), args.device)
    row["sdpa fwd+bwd"] = e2e_ms(lambda: sdpa(True), args.device)
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError:
        chunk_linear_attn = None
    if chunk_linear_attn is not None:
        fm, s = est.feature_map, args.d**-0.25

        def fla(backward: bool) -> None:
            fq, fk = fm.query(q * s).transpose(1, 2), fm.key(k * s).transpose(1, 2)
            out, _ = chunk_linear_attn(fq, fk, v.transpose(1, 2), scale=1.0, normalize=True)
            if backward:
                out.float().square().mean().backward()

        row["fla fwd"] = e2e_ms(lambda: fla(False), args.device)
        row["fla fwd+bwd"] = e2e_ms(lambda: fla(True), args.device)
    print(f"N={n}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items()), flush=True)
    return row


def args_lengths(args: argparse.Namespace) -> list[int]:
    return [65536] if args.seq_len == 16384 else []


def composed_cfg(entry: dict, bt: int):  # type: ignore[no-untyped-def]
    return config_of({"bt": bt, **entry["kernels"]["prep"]}, entry["kernels"])


if __name__ == "__main__":
    sys.exit(main())
