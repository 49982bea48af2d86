"""Engine benchmarks (``nox -s bench``): linear-time estimators against exact softmax
attention measured in the same run. pytest-benchmark prints each group with ratios to
its fastest member; compare within a group, never across runs or machines.
"""

from __future__ import annotations

import pytest
import torch

import kernelattn_core as ka

pytestmark = pytest.mark.benchmark

LENGTHS = (1024, 4096)


def _inputs(n: int, d: int = 64, heads: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, heads, n, d, generator=g) * 0.5 for _ in range(3))  # type: ignore[return-value]


def _forward(benchmark, est: ka.AttentionEstimator, n: int, causal: bool) -> None:  # type: ignore[no-untyped-def]
    q, k, v = _inputs(n)
    est.eval()
    with torch.no_grad():
        benchmark.pedantic(lambda: est(q, k, v, causal=causal), rounds=5, warmup_rounds=1, iterations=1)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("name", ["softmax", "elu", "prf"])
def test_forward(benchmark, name: str, causal: bool, n: int) -> None:  # type: ignore[no-untyped-def]
    benchmark.group = f"forward {'causal' if causal else 'noncausal'} N={n}"
    if name not in ka.get_registry().names():
        pytest.skip(f"{name!r} is not installed")
    _forward(benchmark, ka.create(name, **({"num_features": 64} if name == "prf" else {})), n, causal)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_forward_torch_sdpa(benchmark, causal: bool, n: int) -> None:  # type: ignore[no-untyped-def]
    """The baseline people use today: torch's fused scaled_dot_product_attention."""
    benchmark.group = f"forward {'causal' if causal else 'noncausal'} N={n}"
    q, k, v = _inputs(n)
    with torch.no_grad():
        benchmark.pedantic(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
            rounds=5,
            warmup_rounds=1,
            iterations=1,
        )


@pytest.mark.parametrize("chunk", [16, 64, 256])
def test_causal_chunk_size(benchmark, chunk: int) -> None:  # type: ignore[no-untyped-def]
    benchmark.group = "causal chunk size N=4096"
    _forward(benchmark, ka.create("elu", chunk_size=chunk), 4096, True)
