"""One rank of the sequence-parallel test (run as a script by ``test_sequence_parallel.py``).

``python sp_worker.py RANK WORLD PORT OUT``: joins a gloo group on 127.0.0.1, runs
``sequence_parallel_attention`` on its shard of fixed float64 inputs for each case of
``CASES`` and saves its rows of the output and of the gradients to ``OUT/rank{RANK}.pt``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# name, map options, causal, shard lengths (rank order), backend
CASES = [
    ("prf", {}, True, (13, 11), "torch"),
    ("prf", {}, False, (13, 11), "torch"),
    ("elu", {}, True, (9, 15), "torch"),
    ("prf-hyperbolic", {}, True, (16, 8), "torch"),
]
if importlib.util.find_spec("triton") is not None:
    CASES.append(("prf", {}, True, (16, 8), "triton"))  # local chunks by the triton kernels (fused)


def inputs(seed: int = 0, n: int = 24):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 2, n, 6, generator=g, dtype=torch.float64)
    w = torch.randn(2, 2, n, 6, generator=g, dtype=torch.float64)  # loss weights
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[0, :4] = True  # padding at the start of the first rank's shard
    mask[1, 18:] = True  # ragged: the second sequence ends inside the last shard
    return q, k, v, w, mask


def estimator(name: str, opts: dict, seed: int):
    from kernelattn_core.builtins.estimators import FeatureMapAttention

    torch.manual_seed(seed)  # each rank draws differently: the broadcast must make them agree
    return FeatureMapAttention(name, head_dim=8, **({"num_features": 16} if name != "elu" else {}), **opts).double()


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    from kernelattn_core.engine.distributed import sequence_parallel_attention

    results = []
    for name, opts, causal, lengths, backend in CASES:
        q, k, v, w, mask = inputs()
        start = sum(lengths[:rank])
        sl = slice(start, start + lengths[rank])
        est = estimator(name, opts, seed=1 if rank == 0 else 100 + rank)
        qs, ks, vs = (t[:, :, sl].clone().requires_grad_() for t in (q, k, v))
        o = sequence_parallel_attention(qs, ks, vs, est, causal=causal, key_padding_mask=mask[:, sl], backend=backend)
        (o * w[:, :, sl]).sum().backward()
        results.append({"out": o.detach(), "dq": qs.grad, "dk": ks.grad, "dv": vs.grad})
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
