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
                model = ka.KernelAttention(8, 2, estimator=name, batch_first=True, **_options(name, seed))
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


def _run_two_ranks(names: list[str], out_dir: Path, target: object = None) -> list[dict[str, object]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    work = _worker if target is None else target
    procs = [ctx.Process(target=work, args=(rank, port, names, str(out_dir))) for rank in range(2)]
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


STATS_NAMES = ("cexp", "hcexp")


def _stats_batches(rank: int) -> list[torch.Tensor]:
    """Three training batches ``[2, 6, 8]`` of rank ``rank`` (each rank its own data)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(2, 6, 8, generator=g, dtype=torch.float64) * (1.0 + rank) for _ in range(3)]


def _stats_model(name: str, sync: bool) -> ka.KernelAttention:
    torch.manual_seed(0)
    return (
        ka.KernelAttention(8, 2, estimator=name, num_features=8, seed=3, sync=sync, batch_first=True).double().train()
    )


def _stats_worker(rank: int, port: int, names: list[str], out_dir: str) -> None:
    """Each rank trains (forward only) on its own batches; records the map's statistics and
    an eval output on a fixed batch."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    probe = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    results: dict[str, object] = {}
    for name in names:
        for sync in (True, False):
            model = _stats_model(name, sync)
            with torch.no_grad():
                for x in _stats_batches(rank):
                    model(x)
                model.eval()
                out, _ = model(probe)
            stats = {k: t.clone() for k, t in model.estimator.feature_map.state_dict().items() if "running" in k}
            results[f"{name} (sync={sync})"] = (out, stats)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_data_adapted_statistics_are_pooled_over_the_ranks(tmp_path: Path) -> None:
    """cexp/hcexp running statistics (and so eval outputs) were per rank: two replicas fed
    different data drifted apart (eval outputs differed by up to 1e-4). With ``sync``
    (the default) every rank holds the statistics of the pooled batch, the same as one
    process trained on both ranks' batches; ``sync=False`` keeps them per rank (the
    negative control: there they differ)."""
    pytest.importorskip("kernelattn_prf")
    r0, r1 = _run_two_ranks(list(STATS_NAMES), tmp_path, target=_stats_worker)
    probe = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for name in STATS_NAMES:
        (out0, s0), (out1, s1) = r0[f"{name} (sync=True)"], r1[f"{name} (sync=True)"]
        single = _stats_model(name, sync=True)
        with torch.no_grad():
            for a, b in zip(_stats_batches(0), _stats_batches(1)):
                single(torch.cat([a, b]))  # one process, the pooled batch
            single.eval()
            ref, _ = single(probe)
        ref_stats = {k: t for k, t in single.estimator.feature_map.state_dict().items() if "running" in k}
        assert s0 and set(s0) == set(ref_stats)
        for key in s0:
            torch.testing.assert_close(s0[key], s1[key], rtol=1e-12, atol=1e-12, msg=f"{name}: {key} across ranks")
            torch.testing.assert_close(s0[key], ref_stats[key], rtol=1e-9, atol=1e-9, msg=f"{name}: {key} vs pooled")
        torch.testing.assert_close(out0, out1, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out0, ref, rtol=1e-9, atol=1e-9)
        (p0, q0), (p1, q1) = r0[f"{name} (sync=False)"], r1[f"{name} (sync=False)"]
        assert not torch.allclose(p0, p1, atol=1e-6), f"{name}: per-rank statistics should differ (control)"
        assert any(not torch.allclose(q0[k], q1[k]) for k in q0)


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
