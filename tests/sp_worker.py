"""One rank of the sequence-parallel tests (run as a script by ``test_sequence_parallel.py``).

``python sp_worker.py MODE RANK WORLD PORT OUT``: joins a gloo group on 127.0.0.1 and

* ``agree``: runs ``sequence_parallel_attention`` on its shard of fixed float64 inputs for
  each case of :data:`CASES` (finite and non-finite inputs; an empty shard when
  ``WORLD = 3``) and saves its rows of the output, the input gradients and its share of
  the parameter gradients to ``OUT/agree{RANK}.pt``;
* ``faults``: runs each fault of :data:`FAULTS` (two ranks) on a fresh subgroup, with a
  3-second timeout, and saves what every call raised and how long it took to
  ``OUT/faults{RANK}.json``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

N = 24
#: shard lengths for 2 and 3 ranks (the 3-rank split has an empty shard)
LENGTHS = {2: (13, 11), 3: (9, 0, 15)}

# name, options, causal, corruption: None or (tensor, global position, value)
_CORRUPT = [None, ("k", 15, float("nan")), ("v", 5, float("inf")), ("q", 17, float("nan")), ("pad", 20, float("nan"))]
CASES: list[tuple[str, dict, bool, tuple | None, str]] = []
for _name, _opts in (
    ("prf", {}),
    ("elu", {}),
    ("rfa-features", {}),
    ("hedgehog", {}),
    ("gmm-prf", {}),
    ("trig-softmax", {}),
    ("schoenbat", {"kernel": "exp"}),
):
    for _causal in (True, False):
        for _bad in _CORRUPT:
            CASES.append((_name, _opts, _causal, _bad, "torch"))
if importlib.util.find_spec("triton") is not None:
    CASES.append(("prf", {}, True, None, "triton"))  # local chunks by the triton kernels (fused)


def inputs(seed: int = 0, n: int = N, bad: tuple | None = None):
    g = torch.Generator().manual_seed(seed)
    q, k = (0.7 * torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 2, n, 6, generator=g, dtype=torch.float64)
    w = torch.randn(2, 2, n, 6, generator=g, dtype=torch.float64)  # loss weights
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[0, :4] = True  # padding at the start of the first shard
    mask[1, 18:] = True  # ragged: the second sequence ends inside the last shard
    if bad is not None:
        where, pos, value = bad
        if where == "pad":  # a padded slot (batch 1 is padded from 18 on) holding NaN in k and v
            k[1, :, pos] = value
            v[1, :, pos] = value
        else:
            {"q": q, "k": k, "v": v}[where][0, :, pos] = value
    return q, k, v, w, mask


def estimator(name: str, opts: dict, seed: int):
    import kernelattn_core as ka

    torch.manual_seed(0)  # learned parameters alike on every rank (DDP would broadcast them)
    budget = {} if name == "elu" else {"num_features": 16}
    # each rank draws its random features with another seed: the broadcast must make them agree
    return ka.create(name, head_dim=8, seed=seed, **budget, **opts).double()


def _param_grads(est) -> dict:  # type: ignore[no-untyped-def]
    return {n: p.grad.clone() for n, p in est.named_parameters() if p.grad is not None}


def _agree(rank: int, world: int, out: str) -> None:
    from kernelattn_core.engine.distributed import sequence_parallel_attention

    lengths = LENGTHS[world]
    start = sum(lengths[:rank])
    sl = slice(start, start + lengths[rank])
    results = []
    for name, opts, causal, bad, backend in CASES:
        q, k, v, w, mask = inputs(bad=bad)
        # other seeds on the other ranks: the broadcast must make the draws agree (rmf draws
        # its degrees too, so its buffers' shapes depend on the seed, and gmm-prf draws its
        # initial parameters from it, which DDP would broadcast: the same seed everywhere)
        same = name in ("schoenbat", "gmm-prf")
        est = estimator(name, opts, seed=1 if rank == 0 or same else 100 + rank)
        qs, ks, vs = (t[:, :, sl].clone().requires_grad_() for t in (q, k, v))
        o = sequence_parallel_attention(
            qs, ks, vs, est, causal=causal, key_padding_mask=mask[:, sl], backend=backend, timeout=60
        )
        (o * w[:, :, sl]).sum().backward()
        results.append({"out": o.detach(), "dq": qs.grad, "dk": ks.grad, "dv": vs.grad, "params": _param_grads(est)})
    torch.save(results, os.path.join(out, f"agree{rank}.pt"))


# each fault: what rank 0 and rank 1 do differently (see _fault)
FAULTS = (
    "num_features",
    "causal",
    "head_dim",
    "bad_input_on_rank_1",
    "empty_shard_on_rank_1",
    "rank_1_skips_the_call",
    "rank_1_skips_backward",
    "rank_1_dies",
)
TIMEOUT_S = 3.0


def _fault(kind: str, rank: int, group: dist.ProcessGroup) -> dict:
    from kernelattn_core.engine.distributed import sequence_parallel_attention

    q, k, v, w, _ = inputs()
    sl = slice(0, 12) if rank == 0 else slice(12, 24)
    if kind == "empty_shard_on_rank_1" and rank == 1:
        sl = slice(24, 24)
    qs, ks, vs = (t[:, :, sl].clone().requires_grad_() for t in (q, k, v))
    opts: dict = {}
    causal = True
    if kind == "num_features" and rank == 1:
        opts["num_features"] = 32
    if kind == "causal" and rank == 1:
        causal = False
    if kind == "head_dim" and rank == 1:
        qs, ks = qs[..., :4], ks[..., :4]
    if kind == "bad_input_on_rank_1" and rank == 1:
        ks = ks.float()
    import kernelattn_core as ka

    torch.manual_seed(0)
    est = ka.create("prf", seed=0, **{"num_features": 16, **opts}).double()
    if kind == "rank_1_skips_the_call" and rank == 1:
        return {"raised": None, "seconds": 0.0}
    if kind == "rank_1_dies" and rank == 1:
        sys.stdout.flush()
        os._exit(0)
    t0 = time.monotonic()
    try:
        o = sequence_parallel_attention(qs, ks, vs, est, causal=causal, group=group, timeout=TIMEOUT_S)
        if not (kind == "rank_1_skips_backward" and rank == 1):
            (o * w[:, :, sl]).sum().backward()
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}
    return {"raised": None, "seconds": time.monotonic() - t0, "rows": o.shape[2]}


def _faults(rank: int, out: str) -> None:
    results = {}
    path = os.path.join(out, f"faults{rank}.json")
    for kind in FAULTS:
        group = dist.new_group([0, 1], timeout=timedelta(seconds=30))  # a fresh group: a timeout leaves no debris
        if kind == "rank_1_dies" and rank == 1:
            with open(path, "w") as fh:  # written before dying
                json.dump(results, fh)
        results[kind] = _fault(kind, rank, group)
    with open(path, "w") as fh:
        json.dump(results, fh)


def main() -> None:
    mode, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    if mode == "agree":
        _agree(rank, world, out)
        dist.barrier()
        dist.destroy_process_group()
    else:
        _faults(rank, out)
        os._exit(0)  # the dead rank's group cannot be destroyed cleanly


if __name__ == "__main__":
    main()
