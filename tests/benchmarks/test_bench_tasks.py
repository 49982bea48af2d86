"""Task-benchmark and check benchmarks (``nox -s bench``), each against its baseline in the
same run:

* one training step of the task model (MQAR at the quick scale: batch 32, 128 tokens, width
  64, 2 heads, budget 64) eager and through ``torch.compile`` (Inductor; the compilation
  happens in the warm-up rounds, which are not timed): the figures behind
  ``kernelattn tasks --compile`` (docs/tasks.rst, "Where and how it trains");
* one ``schoenbat`` training step (the same MQAR shape) with the Maclaurin plugin's
  hand-written passes (``kernelattn_maclaurin/fast.py``) against their composed torch forms;
* :func:`~kernelattn_core.toolkit.finite_rows` against ``torch.isfinite(x).all(-1)``, the
  check it replaced in the engine and the plugins, and
  :func:`~kernelattn_core.toolkit.all_finite` against ``torch.isfinite(x).all()``.
"""

from __future__ import annotations

import pytest
import torch

from kernelattn_core.toolkit import finite_rows

pytestmark = pytest.mark.benchmark


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's own, raised while Inductor compiles
@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("estimator", ["exact", "prf", "hedgehog:init=prf", "sliding-window:init=prf"])
def test_task_step(benchmark, estimator: str, mode: str) -> None:  # type: ignore[no-untyped-def]
    import torch._dynamo as dynamo

    benchmark.group = f"task step (MQAR quick): {estimator}"
    benchmark.pedantic(_mqar_step(estimator, compiled=mode == "compiled"), rounds=12, warmup_rounds=3)
    dynamo.reset()


@pytest.mark.parametrize("impl", ["fast", "composed"])
def test_maclaurin_task_step(benchmark, monkeypatch, impl: str) -> None:  # type: ignore[no-untyped-def]
    from kernelattn_maclaurin import fast, feature_maps, normalizers

    if impl == "composed":  # the torch compositions the hand-written passes replaced
        monkeypatch.setattr(feature_maps, "degree_products", fast.degree_products_composed)
        monkeypatch.setattr(normalizers, "unit_rows", fast.unit_rows_composed)
        monkeypatch.setattr(normalizers, "signed_power", fast.signed_power_composed)
    benchmark.group = "task step (MQAR quick): schoenbat"
    benchmark.pedantic(_mqar_step("schoenbat"), rounds=12, warmup_rounds=3)


def _mqar_step(estimator: str, compiled: bool = False):  # type: ignore[no-untyped-def]
    """One training step of the MQAR task model with ``estimator`` (a closure over four
    fixed batches, taken in turn)."""
    from kernelattn_core.tasks import get_task
    from kernelattn_core.tasks.run import RECIPES, _registry_name, budget_options
    from kernelattn_core.tasks.train import build_model, loss_and_hits

    task = get_task("mqar")
    config = RECIPES[("mqar", "quick")]
    options = budget_options(estimator, None if estimator == "exact" else 64, True, 32)
    model = build_model(task, _registry_name(estimator), config, "quick", 0, options).train()
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batches = [task.batch(config.batch_size, scale="quick", generator=g) for _ in range(4)]
    state = {"i": 0}

    def step() -> None:
        batch = batches[state["i"] % len(batches)]
        state["i"] += 1
        loss, _, _ = loss_and_hits(model, batch, forward)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


@pytest.mark.parametrize("impl", ["finite_rows", "isfinite.all"])
def test_row_finiteness_check(benchmark, impl: str) -> None:  # type: ignore[no-untyped-def]
    benchmark.group = "row finiteness of [8, 12, 512, 32]"
    x = torch.randn(8, 12, 512, 32, generator=torch.Generator().manual_seed(0))
    fn = finite_rows if impl == "finite_rows" else (lambda t: torch.isfinite(t).all(-1))
    benchmark.pedantic(fn, args=(x,), rounds=20, warmup_rounds=2)


@pytest.mark.parametrize("impl", ["all_finite", "isfinite.all"])
def test_all_finiteness_check(benchmark, impl: str) -> None:  # type: ignore[no-untyped-def]
    from kernelattn_core.toolkit import all_finite

    benchmark.group = "all finite, [32, 2, 128, 32]"
    x = torch.randn(32, 2, 128, 32, generator=torch.Generator().manual_seed(0))
    fn = all_finite if impl == "all_finite" else (lambda t: bool(torch.isfinite(t).all()))
    benchmark.pedantic(fn, args=(x,), rounds=50, warmup_rounds=2)
