"""Replicas agree on their random draws under DistributedDataParallel.

Two gloo processes on 127.0.0.1 (a free port, spawned, each with a *different* global
torch seed and ``broadcast_buffers=False``, so nothing but the estimator's own seed
agreement can make them match) build every random estimator inside
:class:`~kernelattn_core.KernelAttention`, with and without ``seed``, and take several
training steps with redraws. Their buffers (the draws, shapes included) and outputs must
be identical after every step.
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import kernelattn_core as ka

STEPS = 4
SEEDS = (None, 1234)
TIMEOUT_S = 240


def random_estimator_names() -> list[str]:
    """Every registered estimator or feature map whose output depends on random draws."""
    return [e.name for e in ka.get_registry().entries() if e.kind in ("estimator", "feature_map") and e.cls.random]


def _options(name: str, seed: int | None) -> dict[str, object]:
    entry = ka.get_registry().get(name)
    opts: dict[str, object] = {"num_features": 8}
    if entry.kind == "feature_map":
        opts["redraw_every"] = 1
    else:
        params = inspect.signature(entry.cls.__init__).parameters
        if "redraw_every" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            opts["redraw_every"] = 1
    if seed is not None:
        opts["seed"] = seed
    if not getattr(entry.cls, "supports_noncausal", True):
        opts["causal"] = True  # a causal-only estimator (a gated recurrence) refuses causal=False
    return opts


def _worker(rank: int, port: int, names: list[str], out_dir: str) -> None:
    import warnings

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    # broadcast_buffers=False is the case under test (no buffer sync at all); torch 2.13 deprecates the name
    warnings.filterwarnings("ignore", message=".*broadcast_buffers", category=FutureWarning)
    torch.set_num_threads(1)
    torch.manual_seed(1000 + rank)  # different global generators: agreement must not rely on them
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    results: dict[str, object] = {}
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))  # the same batch on both ranks
    for name in names:
        for seed in SEEDS:
            key = f"{name} (seed={seed})"
            try:
                model = ka.KernelAttention(8, 2, estimator=name, **_options(name, seed))
                ddp = DistributedDataParallel(model, broadcast_buffers=False)
                ddp.train()
                record = []
                for _ in range(STEPS):
                    out, _ = ddp(x)
                    out.square().sum().backward()
                    state = {k: t.detach().clone() for k, t in model.estimator.state_dict().items()}
                    record.append((out.detach().clone(), state))
                results[key] = record
            except Exception as exc:  # reported by the parent, naming the estimator
                results[key] = f"{type(exc).__name__}: {exc}"
            dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(names: list[str], out_dir: Path) -> list[dict[str, object]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, names, str(out_dir))) for rank in range(2)]
    # the ranks unpickle this module's _worker by its name (tests.test_ddp): spawn gives them
    # the parent's sys.path, so the repository root must be on it (an installed, non-editable
    # package does not put it there)
    root = str(Path(__file__).resolve().parents[1])
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)
    try:
        for p in procs:
            p.start()
    finally:
        if added:
            sys.path.remove(root)
    for p in procs:
        p.join(TIMEOUT_S)
    for p in procs:  # bounded: a hung rank is stopped, never left behind
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    assert codes == [0, 0], f"ranks exited with {codes} (killed after {TIMEOUT_S} s if None or negative)"
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _divergences(r0: dict[str, object], r1: dict[str, object]) -> list[str]:
    problems = []
    for key in r0:
        a, b = r0[key], r1[key]
        if isinstance(a, str) or isinstance(b, str):
            problems.append(f"{key}: failed: rank 0: {a if isinstance(a, str) else 'ok'}; rank 1: {b}")
            continue
        for step, ((out0, s0), (out1, s1)) in enumerate(zip(a, b)):
            shapes0 = {k: tuple(t.shape) for k, t in s0.items()}
            shapes1 = {k: tuple(t.shape) for k, t in s1.items()}
            if shapes0 != shapes1:
                problems.append(f"{key}: step {step}: buffer shapes differ between ranks: {shapes0} vs {shapes1}")
                break
            bad = [k for k in s0 if not torch.equal(s0[k], s1[k])]
            if bad:
                problems.append(f"{key}: step {step}: buffers differ between ranks: {bad}")
                break
            if not torch.equal(out0, out1):
                gap = float((out0 - out1).abs().max())
                problems.append(f"{key}: step {step}: outputs differ between ranks by {gap:.3g}")
                break
    return problems


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_replicas_draw_identical_features_with_and_without_seed(tmp_path: Path) -> None:
    names = random_estimator_names()
    assert len(names) >= 10, names
    r0, r1 = _run_two_ranks(names, tmp_path)
    assert set(r0) == set(r1) == {f"{n} (seed={s})" for n in names for s in SEEDS}
    problems = _divergences(r0, r1)
    assert not problems, "replica divergence:\n" + "\n".join(problems)


def test_divergence_checker_catches_a_difference() -> None:
    """Negative control: the comparison flags different draws, shapes and outputs."""
    out = torch.zeros(2)
    same = {"w": torch.ones(3)}
    ok = {"x (seed=None)": [(out, same)]}
    assert _divergences(ok, ok) == []
    assert "buffers differ" in _divergences(ok, {"x (seed=None)": [(out, {"w": torch.ones(3) * 2})]})[0]
    assert "shapes differ" in _divergences(ok, {"x (seed=None)": [(out, {"w": torch.ones(4)})]})[0]
    assert "outputs differ" in _divergences(ok, {"x (seed=None)": [(out + 1, same)]})[0]
    assert "failed" in _divergences(ok, {"x (seed=None)": "InputError: seed"})[0]


def test_agreed_seed_outside_a_process_group_follows_the_global_generator() -> None:
    from kernelattn_core.redraw import agreed_seed

    torch.manual_seed(5)
    a = agreed_seed(None)
    torch.manual_seed(5)
    assert agreed_seed(None) == a
    assert agreed_seed(7) == 7
    with pytest.raises(ka.InputError, match="seed: expected an int or None"):
        agreed_seed("7")  # type: ignore[arg-type]


if __name__ == "__main__":  # pragma: no cover - manual run
    sys.exit(pytest.main([__file__, "-q"]))
