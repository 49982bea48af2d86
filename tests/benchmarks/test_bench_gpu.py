"""GPU benchmark of the triton backend (``nox -s bench -- -m gpu``; skipped without CUDA).

B = 2, H = 16, d = 128, m = 128 PRF features, T = 4K / 16K / 64K, bfloat16, causal;
forward and forward+backward, in one run, against

* flash-linear-attention's ``chunk_linear_attn`` fed materialised PRF features
  (the feature map runs in torch first: what users of fla do today), and
* ``torch.nn.functional.scaled_dot_product_attention`` (flash attention), exact.

pytest-benchmark groups each (T, pass) and prints ratios to the fastest member; the
GPU's name is in ``extra_info``. The medians, the ratios and the issue's goals (causal
forward+backward at 16K no slower than fla; at least 5x faster than flash attention at
64K) are written to ``.benchmarks/gpu_table.md`` at the end of the module. Figures go to
``docs/backends.rst``. A case that runs out of memory is recorded as such (flash
attention's backward at 64K needs several GiB) instead of failing the run.
"""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import pytest
import torch

import kernelattn_core as ka

B, H, D, M = 2, 16, 128, 128
LENGTHS = (4096, 16384, 65536)
IMPLS = ("kernelattn-triton-fused", "fla-chunk-linear-attn", "torch-sdpa")


def _inputs(t: int, grad: bool):
    g = torch.Generator(device="cuda").manual_seed(0)
    return tuple(
        (torch.randn(B, H, t, D, generator=g, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(grad)
        for _ in range(3)
    )


def _prf():
    est = ka.create("prf", num_features=M, head_dim=D).cuda().eval()
    return est


def _step(impl: str, t: int, backward: bool):  # type: ignore[no-untyped-def]
    q, k, v = _inputs(t, backward)
    if impl == "kernelattn-triton-fused":
        est = _prf()

        def run():
            out = ka.kernel_attention(q, k, v, est, causal=True, backend="triton")
            assert est.last_backend == "triton"
            return out

    elif impl == "fla-chunk-linear-attn":
        if importlib.util.find_spec("fla") is None:
            pytest.skip("flash-linear-attention is not installed")
        from fla.ops.linear_attn import chunk_linear_attn

        fm = _prf().feature_map
        s = D**-0.25

        def run():
            # materialised PRF features [B, H, T, m], then fla's layout [B, T, H, m]
            fq = fm.query(q * s).transpose(1, 2)
            fk = fm.key(k * s).transpose(1, 2)
            out, _ = chunk_linear_attn(fq, fk, v.transpose(1, 2), scale=1.0, normalize=True)
            return out

    else:

        def run():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def once():
        out = run()
        if backward:
            out.float().sum().backward()
        torch.cuda.synchronize()

    return once


#: (impl, T, pass) -> median seconds, or a string saying why there is none
RESULTS: dict[tuple[str, int, str], float | str] = {}


def table(results: dict[tuple[str, int, str], float | str], gpu: str) -> str:
    """The medians, the ratios to fla and to SDPA, and the goals, as markdown."""

    def cell(v: float | str | None) -> str:
        return "-" if v is None else v if isinstance(v, str) else f"{v * 1e3:.2f} ms"

    def ratio(a: float | str | None, b: float | str | None) -> float | None:
        return a / b if isinstance(a, float) and isinstance(b, float) else None

    lines = [f"# GPU benchmark ({gpu}; B={B}, H={H}, d={D}, m={M} PRF features, bfloat16, causal)", ""]
    lines += ["| T | pass | " + " | ".join(IMPLS) + " | kernelattn / fla | SDPA / kernelattn |", "|" + "---|" * 7]
    for t in LENGTHS:
        for mode in ("fwd", "fwd+bwd"):
            got = {impl: results.get((impl, t, mode)) for impl in IMPLS}
            r1 = ratio(got[IMPLS[0]], got[IMPLS[1]])
            r2 = ratio(got[IMPLS[2]], got[IMPLS[0]])
            cells = [cell(got[i]) for i in IMPLS] + [f"{r1:.2f}x" if r1 else "-", f"{r2:.1f}x" if r2 else "-"]
            lines.append(f"| {t} | {mode} | " + " | ".join(cells) + " |")
    lines += ["", "## Goals", ""]
    vs_fla = ratio(results.get((IMPLS[0], 16384, "fwd+bwd")), results.get((IMPLS[1], 16384, "fwd+bwd")))
    vs_sdpa = ratio(results.get((IMPLS[2], 65536, "fwd+bwd")), results.get((IMPLS[0], 65536, "fwd+bwd")))
    for text, value, ok in (
        ("causal fwd+bwd T=16K, kernelattn / fla <= 1.0", vs_fla, lambda r: r <= 1.0),
        ("causal fwd+bwd T=64K, SDPA / kernelattn >= 5", vs_sdpa, lambda r: r >= 5.0),
    ):
        lines.append(
            f"- {text}: " + ("not measured" if value is None else f"{value:.2f} ({'met' if ok(value) else 'MISSED'})")
        )
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module", autouse=True)
def write_table(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    yield
    if RESULTS:
        out = Path(request.config.rootpath) / ".benchmarks" / "gpu_table.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table(RESULTS, torch.cuda.get_device_name()))


@pytest.mark.benchmark
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("t", LENGTHS, ids=[f"T={t // 1024}K" for t in LENGTHS])
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_causal_attention(benchmark, impl: str, t: int, backward: bool) -> None:  # type: ignore[no-untyped-def]
    benchmark.group = f"causal B={B} H={H} d={D} m={M} T={t} {'fwd+bwd' if backward else 'fwd'}"
    benchmark.extra_info["gpu"] = torch.cuda.get_device_name()
    mode = "fwd+bwd" if backward else "fwd"
    once = _step(impl, t, backward)
    try:
        once()  # compiles the kernels outside the timed rounds
    except torch.cuda.OutOfMemoryError:
        RESULTS[(impl, t, mode)] = "out of memory"
        torch.cuda.empty_cache()
        pytest.skip(f"{impl} at T={t} ({mode}) ran out of GPU memory")
    benchmark.pedantic(once, rounds=5, warmup_rounds=1, iterations=1)
    RESULTS[(impl, t, mode)] = statistics.median(benchmark.stats.stats.data)


def test_table_goals_and_missing_cells() -> None:
    """The table writer (runs without a GPU): ratios, goals met or missed, cells not measured."""
    res: dict[tuple[str, int, str], float | str] = {
        (IMPLS[0], 16384, "fwd+bwd"): 0.010,
        (IMPLS[1], 16384, "fwd+bwd"): 0.012,
        (IMPLS[0], 65536, "fwd+bwd"): 0.050,
        (IMPLS[2], 65536, "fwd+bwd"): 0.200,
    }
    text = table(res, "a GPU")
    assert "| 16384 | fwd+bwd | 10.00 ms | 12.00 ms | - | 0.83x | - |" in text
    assert "kernelattn / fla <= 1.0: 0.83 (met)" in text
    assert "SDPA / kernelattn >= 5: 4.00 (MISSED)" in text
    assert "| 4096 | fwd | - | - | - | - | - |" in text
