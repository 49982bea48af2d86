"""The torch-side work around the Triton kernels of one call, counted without a GPU.

One ``kernel_attention(q, k, v, create(ESTIMATOR), causal=True, backend="triton")`` and its
backward pass run on CPU tensors with the kernels' launches recorded instead of run
(:func:`~kernelattn_core.engine.triton_backend.record_launches`; their outputs are left
unwritten, so the numbers are garbage, the shapes are not), under a
``TorchDispatchMode`` that adds up, for every torch operation that is not a view or an
allocation, the bytes of its tensor operands and results: the elementwise traffic the
call makes besides its kernels, forward and backward, grouped by operation. On the H200
such traffic runs at roughly 3-4 TB/s, so 5 GB is about 1.5 ms::

    python scripts/triton_host_traffic.py --seq-len 16384 --dtype bfloat16

(B = 2, H = 16, d = D = 128 by default: the GPU benchmark's shape.) The benchmark's own loss
(``out.float().square().mean()``) is counted apart.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Any

#: operations that move no data (views, allocations, metadata)
NO_TRAFFIC = {
    "alias",
    "as_strided",
    "detach",
    "empty",
    "empty_like",
    "expand",
    "full",
    "lift_fresh",
    "new_empty",
    "new_zeros",
    "ones_like",
    "permute",
    "scalar_tensor",
    "select",
    "slice",
    "split",
    "split_with_sizes",
    "squeeze",
    "t",
    "transpose",
    "unsqueeze",
    "view",
    "_unsafe_view",
    "zeros",
}


def count(args: argparse.Namespace) -> dict[str, collections.Counter]:
    """``{phase: Counter(op -> bytes)}`` for the phases ``fwd``, ``loss``, ``bwd``; and the
    launches under ``"launches"`` (kernel name -> count)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import kernelattn_core as ka
    from kernelattn_core.engine import triton_backend as T

    phase = {"now": "fwd"}
    traffic: dict[str, collections.Counter] = {p: collections.Counter() for p in ("fwd", "loss", "bwd")}

    def nbytes(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(nbytes(y) for y in x)
        return 0

    class Traffic(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, fargs=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*fargs, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name.rstrip("_") not in NO_TRAFFIC:
                traffic[phase["now"]][name] += nbytes(fargs) + nbytes(out)
            return out

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    est = ka.create(args.estimator, num_features=args.features, head_dim=args.d).eval()
    q, k, v = (
        (0.5 * torch.randn(args.batch, args.heads, args.seq_len, args.d)).to(dtype).requires_grad_() for _ in range(3)
    )
    with T.record_launches(90) as launches, Traffic():
        out = ka.kernel_attention(q, k, v, est, causal=True, backend="triton")
        phase["now"] = "loss"
        loss = out.float().square().mean()
        phase["now"] = "bwd"
        loss.backward()
    return {**traffic, "launches": collections.Counter(launch.name for launch in launches)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--estimator", default="prf")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    args = p.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the CPU path of the backend's host code
    res = count(args)
    print("launches: " + ", ".join(f"{name} x{n}" for name, n in res["launches"].items()))
    for phase in ("fwd", "loss", "bwd"):
        total = sum(res[phase].values())
        ops = ", ".join(f"{op} {b / 1e9:.2f}" for op, b in res[phase].most_common(8))
        print(f"{phase}: {total / 1e9:.2f} GB ({ops})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
