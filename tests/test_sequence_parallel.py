"""Sequence-parallel feature-map attention over 2 gloo ranks on 127.0.0.1 equals one process.

Each rank is a separate Python process running ``sp_worker.py`` (bounded by a timeout);
the single-process reference runs here on the whole sequence with the same inputs and
the same random features (the worker broadcasts rank 0's draw, which is seeded like the
reference). Float64, outputs and gradients to 1e-6 (they agree to ~1e-15).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import kernelattn_core as ka
from kernelattn_core.engine.distributed import sequence_parallel_attention
from kernelattn_core.errors import InputError

WORKER = Path(__file__).with_name("sp_worker.py")
_spec = importlib.util.spec_from_file_location("kernelattn_sp_worker", WORKER)
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("kernelattn_prf")
    out = tmp_path_factory.mktemp("sp")
    port, world = _free_port(), 2
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(world), str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=180)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"rank failed:\n{log[-3000:]}"
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", range(len(W.CASES)), ids=[f"{c[0]}-{'causal' if c[2] else 'full'}-{c[4]}" for c in W.CASES]
)
def test_two_gloo_ranks_equal_single_process(ranks, case):
    name, opts, causal, lengths, _ = W.CASES[case]
    q, k, v, w, mask = W.inputs()
    est = W.estimator(name, opts, seed=1)  # rank 0's seed: the features every rank used
    qa, ka_, va = (t.clone().requires_grad_() for t in (q, k, v))
    ref = est(qa, ka_, va, causal=causal, key_padding_mask=mask)
    (ref * w).sum().backward()
    got = {key: torch.cat([r[case][key] for r in ranks], dim=2) for key in ("out", "dq", "dk", "dv")}
    for key, r in (("out", ref), ("dq", qa.grad), ("dk", ka_.grad), ("dv", va.grad)):
        torch.testing.assert_close(got[key], r.detach(), rtol=1e-6, atol=1e-6, msg=f"{key} of case {W.CASES[case]}")
    # the chain mattered: the second shard alone (no state from rank 0) differs
    if causal:
        alone = est(
            q[:, :, lengths[0] :],
            k[:, :, lengths[0] :],
            v[:, :, lengths[0] :],
            causal=True,
            key_padding_mask=mask[:, lengths[0] :],
        )
        assert not torch.allclose(alone, got["out"][:, :, lengths[0] :], atol=1e-3)


def test_needs_an_initialised_group_and_a_feature_map_estimator():
    q = torch.randn(1, 1, 4, 4)
    if not dist.is_initialized():
        with pytest.raises(InputError, match="torch.distributed is not initialised"):
            sequence_parallel_attention(q, q, q, ka.create("elu"))
    with pytest.raises(InputError, match="expected a FeatureMapAttention"):
        sequence_parallel_attention(q, q, q, ka.create("softmax"))
