"""What the Triton kernels need on a GPU, measured without one.

The backend's own host code is run on small CPU tensors for every entry of the launch
table (:mod:`.triton_config`) and every way the features reach the kernels, forward,
backward and the decoding step, with :func:`~.triton_backend.record_launches` recording
each launch instead of running it. Every distinct compiled configuration among them
(kernel, constexprs, argument types, warps, stages) is then compiled by Triton's own
compiler (``triton.compile`` for ``GPUTarget("cuda", arch, 32)``, with the ``ptxas``
Triton bundles) in worker processes, and its shared memory (the compiler's allocation,
what a launch checks against the device) and registers and spills (``ptxas -v``) are
read back. ``tests/test_triton_compile.py`` asserts the limits and that
``docs/_generated/triton_resources.inc`` holds the table this produces;
``python -m kernelattn_core.engine.triton_resources`` rewrites that file.

Nothing here imports Triton at module level: the workers must import it with
``TRITON_INTERPRET`` unset (the interpreter replaces ``triton.jit``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

from . import triton_config as C

#: the generated table the docs include
TABLE_FILE = Path(__file__).resolve().parents[2] / "docs" / "_generated" / "triton_resources.inc"
_TL_DTYPES = {"fp32": "float32", "fp64": "float64", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Unit:
    """One compiled configuration, described by plain data (sent to a worker).

    Attributes
    ----------
    arch : int
    name : str
        The launch's name in :data:`~.triton_config.KERNEL_NAMES`.
    kernel : str
        The key of the kernel in :data:`~.triton_kernels.KERNELS`.
    args : tuple
        ``("T", dtype)`` per tensor argument, ``("I", "i32" or "i64")`` per integer.
    constexprs : tuple
        ``(name, kind, value)``; ``kind`` ``"dtype"`` for Triton dtypes.
    num_warps, num_stages : int
    dtype : str
        The call's precision (the table's dtype).
    feat : int
        How the features reach the kernel (:data:`~.triton_config.FEATURE_KINDS`).
    """

    arch: int
    name: str
    kernel: str
    args: tuple
    constexprs: tuple
    num_warps: int
    num_stages: int
    dtype: str
    feat: int

    def key(self) -> str:
        """A hash of the unit, the kernels' source and Triton's version (the cache key of its
        measurement)."""
        text = json.dumps([asdict(self), _source_hash(), _triton_version()], default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def tiles(self) -> str:
        cx = {name: value for name, _, value in self.constexprs}
        return f"BT={cx['BT']} BK={cx['BK']} BV={cx['BV']} BE={cx['BE']}"


@functools.cache
def _triton_version() -> str:
    from importlib.metadata import version

    return version("triton")


@functools.cache
def _source_hash() -> str:
    return hashlib.sha256((Path(__file__).parent / "triton_kernels.py").read_bytes()).hexdigest()


def _describe(launch) -> Unit:  # type: ignore[no-untyped-def]
    import torch

    args = []
    for a in launch.args:
        if isinstance(a, torch.Tensor):
            args.append(("T", str(a.dtype).removeprefix("torch.")))
        else:  # integers are never specialised: only their width reaches the compiler
            args.append(("I", "i32" if -(2**31) <= int(a) < 2**31 else "i64"))
    constexprs = []
    for name, value in sorted(launch.constexprs.items()):
        kind = type(value).__name__
        if hasattr(value, "primitive_bitwidth"):  # a triton dtype
            constexprs.append((name, "dtype", str(value)))
        else:
            constexprs.append((name, kind, value))
    arch, _, _, dtype = launch.key
    return Unit(
        arch=arch,
        name=launch.name,
        kernel="bwd_dqk" if launch.name in ("bwd_dq", "bwd_dk") else launch.name,
        args=tuple(args),
        constexprs=tuple(constexprs),
        num_warps=launch.launch.num_warps,
        num_stages=launch.launch.num_stages,
        dtype=dtype,
        feat=int(launch.constexprs["FEAT"]),
    )


def _drive(arch: int, d: int, num_features: int, dtype: str, feat: int) -> list:
    """Run the backend's host code for one table entry and feature kind (causal and not,
    forward and backward, a decoding step); return the recorded launches."""
    import torch

    from ..interfaces.feature_map import FusedFeatureSpec
    from . import triton_backend as T

    td = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    b, h, n = 1, 1, 2 * C.TABLE[(arch, C.DIMS[0], C.DIMS[0], dtype)].bt + 3
    launches = []
    with T.record_launches(arch) as rec:
        for causal in (True, False):
            v = torch.randn(b, h, n, d, generator=g).to(td).requires_grad_()
            mask = torch.zeros(b, n, dtype=torch.bool)
            if feat <= 1:
                pq, pk = (torch.randn(b, h, n, num_features, generator=g).requires_grad_() for _ in range(2))
                num, den = T.feature_attention_triton(
                    pq, pk, v, log_space=feat == 1, causal=causal, key_padding_mask=mask
                )
            else:
                omega = torch.randn(num_features, d, generator=g)
                family = "exp" if feat == 2 else "trig"
                spec = FusedFeatureSpec(family, omega, lambda x, query: x, lambda x, query: -x.square().sum(-1))
                q, k = (torch.randn(b, h, n, d, generator=g).requires_grad_() for _ in range(2))
                num, den = T.fused_feature_attention_triton(
                    q, k, v, spec, log_space=feat == 2, causal=causal, key_padding_mask=mask
                )
            (num.sum() + den.sum()).backward()
        if feat <= 1:  # the decoding step (materialised features), continuing a state
            pq, pk = (torch.randn(b, h, 1, num_features, generator=g) for _ in range(2))
            v = torch.randn(b, h, 1, d, generator=g).to(td)
            m = torch.zeros(b, h, 1) if feat == 1 else None
            state = T.CausalState(torch.zeros(b, h, num_features, d), torch.zeros(b, h, num_features), m, 3)
            T.feature_attention_step_triton(pq, pk, v, log_space=feat == 1, key_padding_mask=None, state=state)
        launches.extend(rec)
    return launches


#: shapes beyond the table (``d``, ``D``): they take the 256 entries and must launch nothing new
BEYOND = ((512, 512), (24, 520), (300, 16))


def launch_units(
    archs: Iterable[int] = C.ARCHS,
    shapes: Iterable[tuple[int, int]] | None = None,
    dtypes: Iterable[str] = C.DTYPES,
    feats: Iterable[int] = tuple(C.FEATURE_KINDS),
) -> tuple[dict[str, Unit], set[tuple]]:
    """Every distinct compiled configuration the backend launches and the table keys that
    were driven, over ``(d, D)`` ``shapes`` (default: every pair the table lists, and the
    shapes :data:`BEYOND` it) and every feature kind."""
    units: dict[str, Unit] = {}
    driven: set[tuple] = set()
    if shapes is None:
        shapes = [(d, num_features) for d in C.DIMS for num_features in C.DIMS] + list(BEYOND)
    shapes = list(shapes)
    for arch in archs:
        for dtype in dtypes:
            for d, num_features in shapes:
                for feat in feats:
                    for launch in _drive(arch, d, num_features, dtype, feat):
                        driven.add(launch.key)
                        unit = _describe(launch)
                        units.setdefault(unit.key(), unit)
    return units, driven


# ---------------------------------------------------------------------------------- worker
def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def compile_unit(unit: Unit) -> dict:
    """Compile one unit for ``sm_<arch>`` (no GPU needed) and read its resources."""
    import torch
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from . import triton_backend as T
    from . import triton_kernels as K

    kernel = K.KERNELS[unit.kernel]
    if not hasattr(kernel, "params"):
        raise RuntimeError("compile_unit: the kernels were imported under TRITON_INTERPRET=1")
    args = [
        torch.empty(16, dtype=getattr(torch, v)) if kind == "T" else (17 if v == "i32" else 2**40)
        for kind, v in unit.args
    ]
    constexprs = {
        name: getattr(tl, _TL_DTYPES[value]) if kind == "dtype" else value for name, kind, value in unit.constexprs
    }
    target = GPUTarget("cuda", unit.arch, 32)
    backend = make_backend(target)
    opts = {"num_warps": unit.num_warps, "num_stages": unit.num_stages, "enable_fp_fusion": T.FP_FUSION}
    # the runtime's own binder and packing (what `kernel[grid](...)` does before compiling)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **constexprs, **opts)
    options, signature, cx, attrs = kernel._pack_args(backend, {**constexprs, **opts}, bound, specialization, options)
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(ASTSource(kernel, signature, cx, attrs), target=target, options=options.__dict__)
    seconds = time.perf_counter() - start
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs is None or spills is None:
        raise RuntimeError(f"compile_unit: no register report in the ptxas log:\n{text}")
    return {
        "shared": int(compiled.metadata.shared),
        "registers": int(regs.group(1)),
        "spill_stores": int(spills.group(1)),
        "spill_loads": int(spills.group(2)),
        "seconds": round(seconds, 2),
    }


def measure(
    units: dict[str, Unit],
    workers: int | None = None,
    cache: dict[str, dict] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict]:
    """Resources of every unit (from ``cache`` when its key is there), compiled in
    ``workers`` processes (default: one per CPU, at most 8: each imports torch and Triton)."""
    cache = {} if cache is None else cache
    todo = [k for k in units if k not in cache]
    results = {k: cache[k] for k in units if k in cache}
    if todo:
        workers = workers or min(8, os.cpu_count() or 1)
        ctx = get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init) as pool:
            for key, res in zip(todo, pool.map(compile_unit, [units[k] for k in todo])):
                results[key] = res
                if progress is not None:
                    u = units[key]
                    progress(f"sm_{u.arch} {u.dtype} {u.name} FEAT={u.feat}: {res}")
    return results


# ----------------------------------------------------------------------------- the table
def rows(units: dict[str, Unit], results: dict[str, dict]) -> list[dict]:
    """One row per unit (sorted): arch, dtype, kernel, feature kind and its resources."""
    out = []
    for key, u in units.items():
        r = results[key]
        out.append(
            {
                "arch": u.arch,
                "dtype": u.dtype,
                "kernel": u.name,
                "features": C.FEATURE_KINDS[u.feat],
                "tiles": u.tiles(),
                "warps": u.num_warps,
                "stages": u.num_stages,
                **r,
            }
        )
    order = {n: i for i, n in enumerate(C.KERNEL_NAMES)}
    return sorted(out, key=lambda r: (r["arch"], C.DTYPES.index(r["dtype"]), order[r["kernel"]], r["features"]))


def render(table: list[dict]) -> str:
    """The reStructuredText the docs include: per kernel, dtype and architecture, the launch
    and the largest shared memory, registers and spills over the feature kinds."""
    cells: dict[tuple, dict] = {}
    for r in table:
        cell = cells.setdefault((r["kernel"], r["dtype"], r["arch"]), {"shared": 0, "registers": 0, "spills": 0})
        cell["shared"] = max(cell["shared"], r["shared"])
        cell["registers"] = max(cell["registers"], r["registers"])
        cell["spills"] = max(cell["spills"], r["spill_stores"])
        cell["launch"] = f"{r['tiles']}, {r['warps']} warps, {r['stages']} stage{'s' if r['stages'] > 1 else ''}"
    lines = [
        ".. This file is generated by tests/test_triton_compile.py (KERNELATTN_WRITE_RESOURCES=1)",
        "   or python -m kernelattn_core.engine.triton_resources; do not edit it by hand.",
        "",
        f"Measured with Triton {_triton_version()} (``triton.compile`` for ``sm_80`` and ``sm_90``, the bundled",
        f"``ptxas``) over {len(table)} compiled configurations; each row is the largest over the ways the",
        "features reach the kernels that use the entry (float32: all four, and the plain maps of half",
        "inputs; bfloat16 and float16: the log-space ones). Limits: shared memory "
        f"{C.SHARED_LIMIT[80] // 1024} KiB on ``sm_80``,",
        f"{C.SHARED_LIMIT[90] // 1024} KiB on ``sm_90``; spill stores {C.MAX_SPILL_BYTES} bytes, except the entries",
        f"chosen by timing on a GPU (``sm_90`` bfloat16 and float16: {C.MEASURED_SPILL_BYTES} bytes).",
        "",
        ".. list-table::",
        "   :header-rows: 1",
        "",
        "   * - kernel",
        "     - dtype",
        "     - arch",
        "     - launch",
        "     - shared (KiB)",
        "     - registers",
        "     - spills (B)",
    ]
    for name in C.KERNEL_NAMES:
        for dtype in C.DTYPES:
            for arch in C.ARCHS:
                c = cells.get((name, dtype, arch))
                if c is None:
                    continue
                lines += [f"   * - ``{name}``", f"     - {dtype}", f"     - sm_{arch}", f"     - {c['launch']}"]
                lines += [f"     - {c['shared'] / 1024:.1f}", f"     - {c['registers']}", f"     - {c['spills']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Measure every configuration and write :data:`TABLE_FILE`."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    start = time.perf_counter()
    units, _ = launch_units()
    results = measure(units, progress=lambda line: print(line, flush=True))
    table = rows(units, results)
    TABLE_FILE.parent.mkdir(parents=True, exist_ok=True)
    TABLE_FILE.write_text(render(table))
    over = [
        r
        for r in table
        if r["shared"] > C.SHARED_LIMIT[r["arch"]] or r["spill_stores"] > C.spill_limit(r["arch"], r["dtype"])
    ]
    print(f"{len(units)} configurations in {time.perf_counter() - start:.0f} s; {len(over)} over a limit")
    print(f"wrote {TABLE_FILE}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
