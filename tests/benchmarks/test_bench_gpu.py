"""GPU benchmark of the triton backend (``nox -s bench -- -m gpu``; skipped without CUDA).

B = 2, H = 16, d = 128, m = 128 PRF features, T = 4K / 16K / 64K, bfloat16, causal;
forward and forward+backward, in one run, against

* flash-linear-attention's ``chunk_linear_attn`` fed materialised PRF features
  (the feature map runs in torch first: what users of fla do today), and
* ``torch.nn.functional.scaled_dot_product_attention`` (flash attention), exact.

pytest-benchmark groups each (T, pass) and prints ratios to the fastest member; the
GPU's name is in ``extra_info``. Figures go to ``docs/backends.rst``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import kernelattn_core as ka

pytestmark = [
    pytest.mark.benchmark,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

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


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("t", LENGTHS, ids=[f"T={t // 1024}K" for t in LENGTHS])
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_causal_attention(benchmark, impl: str, t: int, backward: bool) -> None:  # type: ignore[no-untyped-def]
    benchmark.group = f"causal B={B} H={H} d={D} m={M} T={t} {'fwd+bwd' if backward else 'fwd'}"
    benchmark.extra_info["gpu"] = torch.cuda.get_device_name()
    once = _step(impl, t, backward)
    benchmark.pedantic(once, rounds=5, warmup_rounds=2, iterations=1)
