"""Collects the engine benchmark's timings and prints the ratio table at the end of the run
(also written to ``.benchmarks/engine_table.md``)."""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

RESULTS = pytest.StashKey[dict]()

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


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[[str, str, int, float], None]:
    """``record(mode, impl, n, seconds)`` stores one measurement for the table."""
    store = request.config.stash[RESULTS]

    def put(mode: str, impl: str, n: int, seconds: float) -> None:
        store[(mode, impl, n)] = seconds

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


def build_table(store: dict) -> str:
    lines = ["# Engine benchmark (one run; B=1, H=4, d=64, m=128 PRF features, fp32)", "", f"Machine: {_machine()}", ""]
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
    return "\n".join(lines) + "\n"


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    store = config.stash.get(RESULTS, {})
    if not store:
        return
    table = build_table(store)
    out = Path(config.rootpath) / ".benchmarks" / "engine_table.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    terminalreporter.write_sep("=", "engine ratio table")
    terminalreporter.write(table)
    terminalreporter.write_line(f"(written to {out})")
