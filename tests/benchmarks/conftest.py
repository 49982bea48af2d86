"""Collects the engine benchmark's timings and prints the ratio table at the end of the run
(also written to ``.benchmarks/engine_table.md``; ``engine_table-no-trim.md`` when glibc
was told to keep freed memory, see :func:`allocator_mode`).

**The allocator is part of the measurement.** On Linux, glibc serves a block of more
than its (dynamic) mmap threshold from fresh pages, and returns the top of the heap to
the system once more than the trim threshold is free there; every such page is faulted
in again on the next call, at about 0.25 ms per MiB on the 2-core VM. Both thresholds
only grow during a process's life, so without care the implementation that runs *first*
in a pytest session pays page faults that the later ones do not. Before the first
benchmark, :func:`steady_allocator` frees one 30 MiB block, which raises both thresholds
to about what a long-running training process has (30 and 60 MiB), for every
implementation alike. The page faults each implementation still pays per call depend
on how much temporary memory it allocates; they are recorded and printed beside the
times, since they explain most of the run-to-run spread of the anchors (fla's chunked
form: 3 to 89 MiB per call at N = 4096, 27 to 51 ms).
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

RESULTS = pytest.StashKey[dict]()
FAULTS = pytest.StashKey[dict]()
MEMORY = pytest.StashKey[dict]()


def allocator_mode() -> str:
    """``"no-trim"`` when glibc was told to keep freed memory (``MALLOC_TRIM_THRESHOLD_`` set
    before Python started), else ``"default"``."""
    return "no-trim" if "MALLOC_TRIM_THRESHOLD_" in os.environ else "default"


@pytest.fixture(scope="session", autouse=True)
def steady_allocator() -> None:
    """Free one 30 MiB block: glibc's dynamic mmap and trim thresholds rise to 30 and
    60 MiB, as in a process that has run for a while (module docstring)."""
    block = torch.ones(30 * 2**18)
    del block


#: (impl, column title) in table order; the reference column is SDPA
IMPLS = (
    ("sdpa", "SDPA"),
    ("kernelattn", "kernelattn prf"),
    ("fla", "fla chunk + PRF"),
    ("performer", "performer-pytorch"),
)
MODES = ("causal fwd", "causal fwd+bwd", "noncausal fwd", "noncausal fwd+bwd")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[RESULTS] = {}
    config.stash[FAULTS] = {}
    config.stash[MEMORY] = {}


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[[str, str, int, float, float], None]:
    """``record(mode, impl, n, seconds, fault_mib)`` stores one measurement for the table
    (``fault_mib``: MiB of minor page faults per call, averaged over the measured calls)."""
    store = request.config.stash[RESULTS]
    faults = request.config.stash[FAULTS]

    def put(mode: str, impl: str, n: int, seconds: float, fault_mib: float) -> None:
        store[(mode, impl, n)] = seconds
        faults[(mode, impl, n)] = fault_mib

    return put


@pytest.fixture
def record_memory(request: pytest.FixtureRequest) -> Callable[[str, int, int], None]:
    """``record_memory(impl, n, peak_bytes)``: peak tensor memory of one forward + backward."""
    store = request.config.stash[MEMORY]

    def put(impl: str, n: int, peak: int) -> None:
        store[(impl, n)] = peak

    return put


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:  # pragma: no cover - not Linux
        pass
    return (
        f"{platform.node()} ({cpu}, {os.cpu_count()} logical CPUs); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )


def _exponent(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log(time) against log(N)."""
    if len(points) < 2:
        return None
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def _fmt(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def build_table(store: dict, faults: dict | None = None, memory: dict | None = None) -> str:
    mode_line = {
        "default": "glibc defaults after one 30 MiB free (steady state; page faults included)",
        "no-trim": "glibc told to keep freed memory (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_MAX_=0): "
        "no page faults after the first call",
    }[allocator_mode()]
    lines = [
        "# Engine benchmark (one run; B=1, H=4, d=64, m=128 PRF features, fp32)",
        "",
        f"Machine: {_machine()}",
        "",
        f"Allocator: {mode_line}",
        "",
    ]
    faults = faults or {}
    lengths = sorted({n for (_, _, n) in store})
    for mode in MODES:
        if not any(k[0] == mode for k in store):
            continue
        lines += [f"## {mode}", ""]
        head = "| N | " + " | ".join(t for _, t in IMPLS) + " | kernelattn / SDPA | fla / SDPA | performer / SDPA"
        lines += [head + " | kernelattn / fla |", "|" + "---|" * (len(IMPLS) + 5)]
        for n in lengths:
            got = {impl: store.get((mode, impl, n)) for impl, _ in IMPLS}
            if all(v is None for v in got.values()):
                continue
            cells = [_fmt(got[impl]) for impl, _ in IMPLS]
            sdpa = got["sdpa"]
            cells += [_ratio(got["kernelattn"], sdpa), _ratio(got["fla"], sdpa), _ratio(got["performer"], sdpa)]
            cells.append(_ratio(got["kernelattn"], got["fla"]))
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        fits = []
        for impl, title in IMPLS:
            pts = [(n, store[(mode, impl, n)]) for n in lengths if n >= 4096 and (mode, impl, n) in store]
            e = _exponent(pts)
            if e is not None:
                fits.append(f"{title} {e:.2f} (N={pts[0][0]}..{pts[-1][0]})")
        lines += ["", "Fitted time exponent: " + "; ".join(fits), ""]
        paged = []
        for impl, title in IMPLS:
            per_n = [f"{n // 1024}K {faults[(mode, impl, n)]:.0f}" for n in lengths if (mode, impl, n) in faults]
            if per_n:
                paged.append(f"{title}: {', '.join(per_n)}")
        if paged:
            lines += ["Page faults per measured call, MiB: " + "; ".join(paged), ""]
    memory = memory or {}
    if memory:
        lines += ["## peak tensor memory of causal fwd+bwd", ""]
        mem_ns = sorted({n for (_, n) in memory})
        lines += ["| N | " + " | ".join(t for i, t in IMPLS if any(k[0] == i for k in memory)) + " |"]
        shown = [i for i, _ in IMPLS if any(k[0] == i for k in memory)]
        lines += ["|" + "---|" * (len(shown) + 1)]
        for n in mem_ns:
            cells = [f"{memory[(i, n)] / 2**20:.1f} MiB" if (i, n) in memory else "-" for i in shown]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        fits = []
        for impl in shown:
            pts = [(n, float(memory[(impl, n)])) for n in mem_ns if (impl, n) in memory]
            e = _exponent(pts)
            if e is not None:
                fits.append(f"{dict(IMPLS)[impl]} {e:.2f} (N={pts[0][0]}..{pts[-1][0]})")
        lines += ["", "Fitted memory exponent: " + "; ".join(fits), ""]
    lines += ["## Goals", ""]

    def get(mode: str, impl: str, n: int) -> float | None:
        return store.get((mode, impl, n))

    def goal(text: str, value: float | None, ok: Callable[[float], bool], fmt: str) -> None:
        if value is None:
            lines.append(f"- {text}: not measured")
        else:
            lines.append(f"- {text}: {fmt.format(value)} ({'met' if ok(value) else 'MISSED'})")

    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b

    goal(
        "causal forward N=4096, kernelattn / fla <= 0.5",
        div(get("causal fwd", "kernelattn", 4096), get("causal fwd", "fla", 4096)),
        lambda r: r <= 0.5,
        "{:.2f}x",
    )
    goal(
        "non-causal forward N=4096, kernelattn / fla <= 0.9",
        div(get("noncausal fwd", "kernelattn", 4096), get("noncausal fwd", "fla", 4096)),
        lambda r: r <= 0.9,
        "{:.2f}x",
    )
    goal(
        "causal forward+backward N=16384, SDPA / kernelattn >= 8",
        div(get("causal fwd+bwd", "sdpa", 16384), get("causal fwd+bwd", "kernelattn", 16384)),
        lambda r: r >= 8,
        "{:.1f}x faster",
    )
    for mode in ("causal fwd", "causal fwd+bwd"):
        pts = [(n, store[(mode, "kernelattn", n)]) for n in lengths if n >= 4096 and (mode, "kernelattn", n) in store]
        goal(f"{mode} time exponent N=4K..32K <= 1.05", _exponent(pts), lambda e: e <= 1.05, "{:.2f}")
    mem_ns = sorted(n for (impl, n) in memory if impl == "kernelattn")
    pts = [(n, float(memory[("kernelattn", n)])) for n in mem_ns]
    goal("causal fwd+bwd peak memory exponent (linear: <= 1.05)", _exponent(pts), lambda e: e <= 1.05, "{:.2f}")
    return "\n".join(lines) + "\n"


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    store = config.stash.get(RESULTS, {})
    if not store and not config.stash.get(MEMORY, {}):
        return
    table = build_table(store, config.stash.get(FAULTS, {}), config.stash.get(MEMORY, {}))
    name = "engine_table.md" if allocator_mode() == "default" else f"engine_table-{allocator_mode()}.md"
    out = Path(config.rootpath) / ".benchmarks" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    terminalreporter.write_sep("=", "engine ratio table")
    terminalreporter.write(table)
    terminalreporter.write_line(f"(written to {out})")
