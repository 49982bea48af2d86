"""Sequence-parallel feature-map attention over gloo ranks on 127.0.0.1 equals one process,
and its faults end every rank within the timeout.

Each rank is a separate Python process running ``sp_worker.py`` (bounded by a timeout);
the single-process reference runs here on the whole sequence with the same inputs and
the same random features (the worker broadcasts rank 0's draw, which is seeded like the
reference). Float64; outputs (NaN where one process has NaN), the gradients of ``q``,
``k``, ``v`` and of every learned parameter (summed over the ranks, as data parallelism
sums them) agree to 1e-6 (they agree to ~1e-15), for finite inputs and for a NaN key, an
``inf`` value, a NaN query and a NaN padded slot, causal and not, with 2 ranks and with 3
ranks of which one holds no position.

CI cost: two launches (3 ranks, then 2 ranks for the faults), about 35 s in all on two
shared cores, of which about 6 s are the two faults that wait for the 3-second timeout.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import kernelattn_core as ka
from kernelattn_core.engine.distributed import DEFAULT_TIMEOUT_S, sequence_parallel_attention
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


def _launch(mode: str, world: int, out: Path, limit: float = 240) -> list[str]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(r), str(world), str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=limit)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"rank failed:\n{log[-3000:]}"
    return logs


@pytest.fixture(scope="module")
def agree(tmp_path_factory):  # type: ignore[no-untyped-def]
    pytest.importorskip("kernelattn_prf")
    out = tmp_path_factory.mktemp("sp")
    _launch("agree", 3, out)
    return [torch.load(out / f"agree{r}.pt") for r in range(3)]


@pytest.fixture(scope="module")
def faults(tmp_path_factory):  # type: ignore[no-untyped-def]
    pytest.importorskip("kernelattn_prf")
    out = tmp_path_factory.mktemp("spf")
    _launch("faults", 2, out)
    return [json.loads((out / f"faults{r}.json").read_text()) for r in range(2)]


def _case_id(case: tuple) -> str:
    name, _, causal, bad, backend = case
    what = "finite" if bad is None else f"{bad[0]}{bad[1]}-{bad[2]}"
    return f"{name}-{'causal' if causal else 'full'}-{what}-{backend}"


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(W.CASES)), ids=[_case_id(c) for c in W.CASES])
def test_three_gloo_ranks_one_empty_equal_single_process(agree, case: int) -> None:
    name, opts, causal, bad, _ = W.CASES[case]
    q, k, v, w, mask = W.inputs(bad=bad)
    est = W.estimator(name, opts, seed=1)  # rank 0's seed: the features every rank used
    qa, ka_, va = (t.clone().requires_grad_() for t in (q, k, v))
    ref = est(qa, ka_, va, causal=causal, key_padding_mask=mask)
    (ref * w).sum().backward()
    got = {key: torch.cat([r[case][key] for r in agree], dim=2) for key in ("out", "dq", "dk", "dv")}
    label = _case_id(W.CASES[case])
    assert got["out"].shape == ref.shape
    torch.testing.assert_close(got["out"], ref.detach(), rtol=1e-6, atol=1e-6, equal_nan=True, msg=f"out of {label}")
    for key, r in (("dq", qa.grad), ("dk", ka_.grad), ("dv", va.grad)):
        assert bool(torch.isfinite(got[key]).all()), f"{key} of {label} is not finite"
        torch.testing.assert_close(got[key], r, rtol=1e-6, atol=1e-6, msg=f"{key} of {label}")
    ref_params = {n: p.grad for n, p in est.named_parameters() if p.grad is not None}
    for n, g in ref_params.items():
        total = sum(r[case]["params"][n] for r in agree if n in r[case]["params"])
        assert bool(torch.isfinite(total).all()), f"gradient of {n} in {label} is not finite"
        torch.testing.assert_close(total, g, rtol=1e-6, atol=1e-6, msg=f"gradient of {n} in {label}")
    if bad is not None and bad[0] != "pad":  # the case is non-finite for real: some row is NaN
        assert bool(torch.isnan(ref).any())
    if causal and bad is None:  # the chain mattered: the last shard alone (no state) differs
        s = sum(W.LENGTHS[3][:2])
        alone = est(q[:, :, s:], k[:, :, s:], v[:, :, s:], causal=True, key_padding_mask=mask[:, s:])
        assert not torch.allclose(alone, got["out"][:, :, s:], atol=1e-3)


def _both(faults, kind: str) -> tuple[dict, dict]:  # type: ignore[no-untyped-def]
    return faults[0][kind], faults[1].get(kind, {"raised": "died"})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "field"), [("num_features", "num_features"), ("causal", "causal"), ("head_dim", "head_dim")]
)
def test_ranks_that_disagree_raise_on_every_rank_naming_the_field(faults, kind: str, field: str) -> None:  # type: ignore[no-untyped-def]
    """Before: a different num_features aborted a process (gloo, exit -6), a different
    causal flag deadlocked."""
    for r, got in enumerate(_both(faults, kind)):
        assert got["raised"] == "InputError", (r, got)
        assert f"disagree on {field}" in got["message"] and "rank 0" in got["message"] and "rank 1" in got["message"]
        assert got["seconds"] < W.TIMEOUT_S  # no wait for the timeout: the exchange tells every rank at once


@pytest.mark.slow
def test_a_rank_with_bad_input_makes_every_rank_raise_at_once(faults) -> None:  # type: ignore[no-untyped-def]
    r0, r1 = _both(faults, "bad_input_on_rank_1")
    assert r1["raised"] == "InputError" and r1["message"].startswith("k:"), r1
    assert r0["raised"] == "SequenceParallelError" and "rank 1: InputError: k:" in r0["message"], r0
    assert r0["seconds"] < W.TIMEOUT_S


@pytest.mark.slow
def test_an_empty_shard_is_a_valid_shard(faults) -> None:  # type: ignore[no-untyped-def]
    """Before: a zero-length shard aborted a process."""
    r0, r1 = _both(faults, "empty_shard_on_rank_1")
    assert r0["raised"] is None and r1["raised"] is None, (r0, r1)
    assert r0["rows"] == 12 and r1["rows"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["rank_1_skips_the_call", "rank_1_skips_backward", "rank_1_dies"])
def test_a_missing_rank_ends_the_others_within_the_timeout(faults, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Before: a rank that raised but stayed alive blocked the others for gloo's default
    30 minutes."""
    r0, _ = _both(faults, kind)
    assert r0["raised"] in ("SequenceParallelTimeout", "SequenceParallelError"), r0
    assert r0["seconds"] < W.TIMEOUT_S + 2.0, r0
    if r0["raised"] == "SequenceParallelTimeout":
        assert "timeout=3" in r0["message"] and "re-create it" in r0["message"]


def test_needs_an_initialised_group_and_a_positive_timeout() -> None:
    q = torch.randn(1, 1, 4, 4)
    if not dist.is_initialized():
        with pytest.raises(InputError, match="torch.distributed is not initialised"):
            sequence_parallel_attention(q, q, q, ka.create("elu"))
    assert math.isfinite(DEFAULT_TIMEOUT_S) and DEFAULT_TIMEOUT_S > 0
