"""Replicas built *before* ``init_process_group`` agree on their draws from the first step.

A model built before the process group exists takes ``seed=None`` from its own rank's
global generator and makes draw 0 with it. The first training forward call after the
group exists agrees the seed (rank 0's, one broadcast per policy, once) and remakes the
draw with it, so two gloo processes with different global seeds and
``broadcast_buffers=False`` hold identical features, outputs and estimator state at every
step, with ``redraw_every`` 0 (never redrawn: the draw 0 of each rank would stay) and 2.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from .test_ddp import _divergences, _run_two_ranks

STEPS = 3

#: (estimator, options) built before the group exists
CASES = {
    "prf every=0": ("prf", {"num_features": 8}),
    "prf every=2": ("prf", {"num_features": 8, "redraw_every": 2}),
    "gmm-prf": ("gmm-prf", {"num_features": 8}),
    "rmfa every=0": ("rmfa", {"num_features": 8}),
    "ra": ("ra", {"num_features": 4}),
    "rfa-snis": ("rfa-snis", {"num_features": 8}),
    "lara": ("lara", {"num_features": 4}),
    # estimators that call the redraw policy themselves (not through FeatureMapAttention)
    "rfa-gate": ("rfa-gate", {"num_features": 8, "causal": True}),
    "sliding-window prf": ("sliding-window", {"window": 2, "feature_map": "prf", "num_features": 8}),
}


def _pre_group_worker(rank: int, port: int, names: list[str], out_dir: str) -> None:
    import warnings

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import kernelattn_core as ka
    from kernelattn_core import redraw

    warnings.filterwarnings("ignore", message=".*broadcast_buffers", category=FutureWarning)
    torch.set_num_threads(1)
    torch.manual_seed(1000 + rank)  # different global generators: different seeds and draws 0
    models = {
        key: ka.KernelAttention(8, 2, estimator=CASES[key][0], batch_first=True, **CASES[key][1]) for key in names
    }
    agreements = [0]
    agreed_seed = redraw.agreed_seed

    def counting(seed=None):  # type: ignore[no-untyped-def]
        agreements[0] += 1
        return agreed_seed(seed)

    redraw.agreed_seed = counting
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    results: dict[str, object] = {}
    counts: dict[str, list[int]] = {}  # seed agreements (collectives) so far, per step
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))  # the same batch on both ranks
    for key, model in models.items():
        try:
            ddp = DistributedDataParallel(model, broadcast_buffers=False)
            ddp.train()
            record = []
            before = agreements[0]
            for _ in range(STEPS):
                out, _ = ddp(x)
                out.square().sum().backward()
                state = {k: t.detach().clone() for k, t in model.estimator.state_dict().items()}
                record.append((out.detach().clone(), state))
                counts.setdefault(key, []).append(agreements[0] - before)
            results[key] = record
        except Exception as exc:  # reported by the parent, naming the case
            results[key] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.save(counts, os.path.join(out_dir, f"counts{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_models_built_before_the_group_agree_from_the_first_step(tmp_path: Path) -> None:
    r0, r1 = _run_two_ranks(list(CASES), tmp_path, target=_pre_group_worker)
    assert set(r0) == set(r1) == set(CASES)
    problems = _divergences(r0, r1)
    assert not problems, "replica divergence:\n" + "\n".join(problems)
    for rank in range(2):  # one collective per policy, at the first step, never again
        counts = torch.load(tmp_path / f"counts{rank}.pt")
        assert counts == {key: [1] * STEPS for key in CASES}, f"rank {rank}: seed agreements per step {counts}"
