"""``scripts/triton_host_traffic.py``: the torch-side traffic around the Triton kernels of
one call, counted on the CPU (launches recorded, not run)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("kernelattn_prf")

T = pytest.importorskip("kernelattn_core.engine.triton_backend")
pytestmark = pytest.mark.skipif(not T.interpreting(), reason="needs TRITON_INTERPRET=1 (CPU interpreter)")

_spec = importlib.util.spec_from_file_location(
    "triton_host_traffic", Path(__file__).resolve().parents[1] / "scripts" / "triton_host_traffic.py"
)
assert _spec is not None and _spec.loader is not None
traffic = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(traffic)


def test_counts_the_kernels_and_the_bytes_of_each_phase() -> None:
    args = argparse.Namespace(estimator="prf", d=16, features=16, dtype="bfloat16", seq_len=64, batch=1, heads=1)
    res = traffic.count(args)
    assert set(res["launches"]) == {"prep", "state_fwd", "out_fwd", "state_bwd", "bwd_dv", "bwd_dq", "bwd_dk"}
    # the loss out.float().square().mean() of 1024 bfloat16 outputs, exactly: the cast reads
    # 2 and writes 4 bytes an element, the square reads and writes 4, the mean reads 4
    # and writes one float
    assert dict(res["loss"]) == {"_to_copy": 1024 * 6, "pow": 1024 * 8, "mean": 1024 * 4 + 4}
    assert sum(res["fwd"].values()) > 0 and sum(res["bwd"].values()) > sum(res["loss"].values())
    assert not set(res["fwd"]) & {"empty", "detach", "expand", "view"}  # no traffic counted for views
