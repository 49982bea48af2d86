"""``scripts/triton_tune.py`` (the GPU launch tuner) as a dry run on the CPU: Triton's
interpreter, two candidates, a tiny shape. What it measures needs a GPU; this keeps its
plumbing (parallel compilation, the correctness check, the composed configuration, the
JSON it writes, the refusal without CUDA) working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("kernelattn_prf")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "triton_tune.py"


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU interpreter's")
def test_dry_run_checks_and_composes_the_candidates(tmp_path: Path) -> None:
    shape = ["--d", "16", "--features", "16", "--seq-len", "100", "--batch", "1", "--heads", "1"]
    grid = ["--bt", "64", "--tiles", "16,16,16", "32,16,16", "--warps", "4", "--stages", "1", "--jobs", "2"]
    proc = _run("--device", "cpu", *shape, *grid, "--out", "tune.json", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "compiled 2 candidates" in proc.stdout and "0 failed" in proc.stdout
    res = json.loads((tmp_path / "tune.json").read_text())
    assert [c["tile"] for c in res["candidates"]] == [[16, 16, 16], [32, 16, 16]]
    for cand in res["candidates"]:  # the same mathematics in other tiles: rounding only
        assert cand["error"] is None and max(cand["rel_err"]) < 1e-2
    assert res["best_bt"] == 64 and set(res["composed"]["64"]["kernels"]) >= {"prep", "bwd_dq", "bwd_dk"}
    assert {"current fwd+bwd", "tuned fwd+bwd", "sdpa fwd+bwd"} <= set(res["anchors"]["100"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_a_gpu(tmp_path: Path) -> None:
    proc = _run("--seq-len", "100", tmp_path=tmp_path)
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr
