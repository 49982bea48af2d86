"""Launch parameters of the Triton kernels: one table, keyed by ``(arch, d, D, dtype)``.

Imports nothing heavy (no Triton): the backend reads it at launch, the compile test
(``tests/test_triton_compile.py``) compiles every entry for ``sm_80`` and ``sm_90`` with
Triton's own compiler and checks the shared memory and the register spills of each
kernel against :data:`SHARED_LIMIT` and :func:`spill_limit`, and the docs show the
resources it measured (``docs/_generated/triton_resources.csv``).

The kernels (:mod:`.triton_kernels`) loop over the features ``D`` in tiles of ``bk``, over
the map's input ``d'`` in tiles of ``be`` and run a program per tile of ``bv`` value
columns, so the work space of a program depends on the tiles alone. The tiles of an entry
therefore do not depend on ``d`` and ``D``; a dimension smaller than its tile is masked.
A dimension above 256 (the largest the table lists) takes the 256 entry: its kernels are
the same compiled binaries (the integer arguments are never specialised), so the compile
test covers it.

Devices: compute capability 9.x takes the ``sm_90`` entries, 8.x and 10.x and later the
``sm_80`` ones (the smaller); below 8.0 the backend does not run
(:func:`arch_of` is ``None``, and ``backend="auto"`` picks torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the shared memory a block may use (opt-in maximum), bytes: A100 163 KiB, H100 227 KiB
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
#: consumer parts of compute capability 8.6 / 8.9 / 12.x allow 99 KiB; the compile test reports
#: whether each sm_80 entry fits it too
SHARED_LIMIT_SMALL = 99 * 1024
#: register spill stores allowed per kernel (bytes, from ``ptxas -v``) in entries not measured on a GPU
MAX_SPILL_BYTES = 0
#: ``(arch, dtype)`` entries chosen by timing on a GPU (:data:`_HALF_SM90`): their kernels may spill
#: up to :data:`MEASURED_SPILL_BYTES`, since the spilling candidates ran faster there than the
#: spill-free ones (4 warps with spills beat 8 warps without by 15 % end to end)
MEASURED = frozenset({(90, "bfloat16"), (90, "float16")})
MEASURED_SPILL_BYTES = 1024


def spill_limit(arch: int, dtype: str) -> int:
    """The spill stores (bytes) a kernel of entry ``(arch, dtype)`` may report."""
    return MEASURED_SPILL_BYTES if (arch, dtype) in MEASURED else MAX_SPILL_BYTES


#: head dimensions ``d`` and feature counts ``D`` the table lists (rounded up to these)
DIMS = (16, 32, 64, 128, 256)
DTYPES = ("float32", "bfloat16", "float16")
ARCHS = (80, 90)
#: launched kernels (``bwd_dq`` / ``bwd_dk`` are ``bwd_dqk_kernel`` with ``SIDE`` 0 / 1)
KERNEL_NAMES = ("prep", "state_fwd", "out_fwd", "state_bwd", "bwd_dv", "bwd_dq", "bwd_dk")
#: how the features reach the kernels (the ``FEAT`` constexpr)
FEATURE_KINDS = {0: "features", 1: "log-features", 2: "fused exp", 3: "fused trig"}


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel's tiles, warps and software-pipelining stages.

    Attributes
    ----------
    bk, bv, be : int
        Tiles of the features ``D``, the value columns ``d_v`` and the map's input ``d'``.
    num_warps, num_stages : int
    """

    bk: int
    bv: int
    be: int
    num_warps: int
    num_stages: int

    def describe(self) -> str:
        return f"BK={self.bk} BV={self.bv} BE={self.be}, {self.num_warps} warps, {self.num_stages} stages"


@dataclass(frozen=True)
class LaunchConfig:
    """The chunk length shared by the kernels of one call and each kernel's launch.

    Attributes
    ----------
    bt : int
        Positions per chunk (the states are stated at chunk boundaries, so every kernel
        of a call uses the same).
    kernels : dict
        :class:`KernelLaunch` of each name in :data:`KERNEL_NAMES`.
    """

    bt: int
    kernels: dict[str, KernelLaunch] = field(hash=False, compare=True)

    def launch(self, name: str) -> KernelLaunch:
        return self.kernels[name]


#: ``(BK, BV, BE)`` of each kernel of the float32 entries (IEEE float32 products, also plain maps
#: with half inputs), 8 warps, 1 stage: the largest tiles without a register spill, found by
#: compiling the candidates (64, 32 and 16 wide, ``BE`` kept at 64 for ``bwd_dq`` / ``bwd_dk``,
#: where a narrower one multiplies their work) with ``triton_resources``; ptxas is not
#: monotone in the tiles, hence the mixture. The half entries take 64 everywhere.
_FLOAT32_TILES = {
    80: {
        "prep": (32, 64, 64),
        "state_fwd": (32, 32, 64),
        "out_fwd": (16, 32, 32),
        "state_bwd": (16, 32, 32),
        "bwd_dv": (32, 64, 64),
        "bwd_dq": (32, 16, 64),
        "bwd_dk": (32, 16, 64),
    },
    90: {
        "prep": (64, 64, 64),
        "state_fwd": (32, 32, 64),
        "out_fwd": (32, 32, 64),
        "state_bwd": (32, 32, 64),
        "bwd_dv": (64, 64, 64),
        "bwd_dq": (64, 16, 64),
        "bwd_dk": (64, 64, 64),
    },
}


#: ``(BK, BV, BE, warps, stages)`` of each kernel of the ``sm_90`` half entries (bfloat16, float16),
#: measured on an NVIDIA H200 (2026-11-27, Triton 3.6, ``scripts/triton_tune.py``: 40 candidates,
#: ``BT`` 64 / 128 x five tilings x 4 / 8 warps x 1 / 2 stages, each kernel's fastest at the
#: fastest ``BT``; PRF, B = 2, H = 16, N = 16384, d = D = 128, causal, forward + backward).
#: The kernels took 11.1 ms instead of 15.2 ms with the earlier 64-wide, 8-warp, 1-stage
#: entry (the whole call 18.3 ms instead of 21.6 ms); ``BT`` = 128 was no faster (18.3 ms)
#: and is 30 times further from the torch backend in bfloat16 (relative RMS 1.5e-3 against
#: 4.4e-5 between the two ``BT`` = 64 entries).
_HALF_SM90 = {
    "prep": (64, 32, 64, 4, 1),
    "state_fwd": (32, 64, 64, 8, 2),
    "out_fwd": (64, 64, 64, 4, 2),
    "state_bwd": (64, 64, 64, 8, 2),
    "bwd_dv": (64, 64, 32, 4, 2),
    "bwd_dq": (64, 32, 64, 4, 2),
    "bwd_dk": (64, 32, 64, 4, 2),
}


def _entry(arch: int, dtype: str) -> LaunchConfig:
    """The configuration of one ``(arch, dtype)``; every ``(d, D)`` shares it (module
    docstring). ``sm_90`` half entries: measured on a GPU (:data:`_HALF_SM90`). The
    others: 8 warps and no software pipelining, chosen without a GPU (with 4 warps or 2
    stages the 64-wide float32 kernels spilled); not yet measured on one."""
    if arch == 90 and dtype != "float32":
        kernels = {name: KernelLaunch(*_HALF_SM90[name][:3], *_HALF_SM90[name][3:]) for name in KERNEL_NAMES}
        return LaunchConfig(bt=64, kernels=kernels)
    tiles = _FLOAT32_TILES[arch] if dtype == "float32" else dict.fromkeys(KERNEL_NAMES, (64, 64, 64))
    kernels = {name: KernelLaunch(*tiles[name], num_warps=8, num_stages=1) for name in KERNEL_NAMES}
    return LaunchConfig(bt=64, kernels=kernels)


def _bucket(n: int) -> int:
    """``n`` rounded up to a power of two in [16, 256]."""
    b = 16
    while b < n and b < DIMS[-1]:
        b *= 2
    return b


#: ``(arch, d, D, dtype) -> LaunchConfig``: the one table the backend reads and the compile test covers
TABLE: dict[tuple[int, int, int, str], LaunchConfig] = {
    (arch, d, feats, dtype): _entry(arch, dtype) for arch in ARCHS for d in DIMS for feats in DIMS for dtype in DTYPES
}


def arch_of(capability: tuple[int, int]) -> int | None:
    """The table's architecture for a device of compute ``capability`` (``None``: not run)."""
    major = capability[0]
    if major < 8:
        return None
    return 90 if major == 9 else 80


def table_key(arch: int, d: int, num_features: int, dtype: str) -> tuple[int, int, int, str]:
    """The entry of a call with head dimension ``d`` (the widest of ``d'`` and ``d_v``),
    ``D`` features and inputs of ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``)."""
    return (arch, _bucket(d), _bucket(num_features), dtype)


def lookup(arch: int, d: int, num_features: int, dtype: str) -> LaunchConfig:
    """The launch parameters of a call (see :func:`table_key`)."""
    return TABLE[table_key(arch, d, num_features, dtype)]


__all__ = [
    "ARCHS",
    "DIMS",
    "DTYPES",
    "FEATURE_KINDS",
    "KERNEL_NAMES",
    "MAX_SPILL_BYTES",
    "MEASURED",
    "MEASURED_SPILL_BYTES",
    "SHARED_LIMIT",
    "SHARED_LIMIT_SMALL",
    "TABLE",
    "KernelLaunch",
    "LaunchConfig",
    "arch_of",
    "lookup",
    "spill_limit",
    "table_key",
]
