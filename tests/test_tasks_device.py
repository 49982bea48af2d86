"""Where and how the task benchmarks train: ``device`` and ``compile`` (``train``,
``run_tasks`` and ``kernelattn tasks --device/--compile``), and exact attention traced as
one graph (its non-finite quarantine as tensor operations), which a compiled comparison
needs for its ceiling."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

import kernelattn_core as ka
from kernelattn_core.cli.main import main
from kernelattn_core.errors import InputError
from kernelattn_core.tasks import get_task
from kernelattn_core.tasks.run import RECIPES, run_tasks
from kernelattn_core.tasks.train import compile_backend, train

TINY = {"steps": 6, "batch_size": 8, "eval_size": 16, "curve_size": 8, "eval_every": 3, "d_model": 32}


def _config():  # type: ignore[no-untyped-def]
    return RECIPES[("mqar", "quick")].updated(**TINY)


def test_an_explicit_cpu_device_is_the_default_run() -> None:
    task = get_task("mqar")
    a = train(task, "prf", _config(), options={"num_features": 8})
    b = train(task, "prf", _config(), options={"num_features": 8}, device=torch.device("cpu"))
    assert a["curve"] == b["curve"] and a["losses"] == b["losses"] and a["accuracy"] == b["accuracy"]
    assert (a["device"], a["compiled"], b["device"]) == ("cpu", False, "cpu")
    assert a["first_step_s"] > 0


@pytest.mark.parametrize("name", ["prf", "softmax"])
def test_a_compiled_run_trains_as_the_eager_one(name: str) -> None:
    """``aot_eager`` traces (Dynamo, AOTAutograd) without generating code: the same
    operations, so the same losses to rounding; the evaluations run the eager model."""
    task = get_task("mqar")
    opts = {"num_features": 8, "seed": 0} if name == "prf" else {}
    eager = train(task, name, _config(), options=opts)
    dynamo.reset()
    compiled = train(task, name, _config(), options=opts, compile="aot_eager")
    dynamo.reset()
    assert compiled["compiled"] == "aot_eager"
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-4, atol=1e-5)
    assert abs(compiled["accuracy"] - eager["accuracy"]) <= 1 / 16  # at most one held-out answer apart


def test_bad_device_and_compile_values_are_refused_before_training() -> None:
    task = get_task("mqar")
    with pytest.raises(InputError, match="device: expected a torch device such as 'cpu' or 'cuda:0', got 'gpu0'"):
        train(task, "prf", _config(), device="gpu0")
    with pytest.raises(InputError, match="compile: expected True, False or a backend name, got 'yes'|compile: exp"):
        train(task, "prf", _config(), compile="yes")
    with pytest.raises(InputError, match=r"compile: expected True, False or a backend name, got 1 \(int\)"):
        compile_backend(1)
    assert (compile_backend(True), compile_backend(False), compile_backend("eager")) == ("inductor", None, "eager")
    with pytest.raises(InputError, match="device: expected a torch device"):
        run_tasks(["mqar"], ["prf"], device="gpu0", progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="device: 'cuda' was asked for, but this torch has no CUDA device"):
            run_tasks(["mqar"], ["prf"], device="cuda", progress=False)


def test_cli_device_and_compile(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["tasks", "--device", "gpu0", "--steps", "1"]) == 2
    assert "--device: expected a torch device such as 'cpu' or 'cuda:0', got 'gpu0'" in capsys.readouterr().err
    assert main(["tasks", "--compile", "nonsense", "--steps", "1"]) == 2
    assert "--compile: expected True, False or a torch.compile backend" in capsys.readouterr().err
    args = ["tasks", "--estimator", "elu", "--steps", "2", "--no-progress", "--format", "json"]
    assert main([*args, "--device", "cpu", "--compile", "aot_eager"]) == 0
    dynamo.reset()
    import json

    captured = capsys.readouterr()
    records = json.loads(captured.out)
    assert {(r["device"], r["compiled"]) for r in records} == {("cpu", "aot_eager")}
    assert "trained on cpu, compiled (aot_eager): compare times only with runs trained the same way" in captured.err
    assert main([*args[:-2]]) == 0  # an eager table says nothing of it
    assert "trained on" not in capsys.readouterr().out


@pytest.mark.parametrize(("causal", "padded"), [(True, False), (True, True), (False, True)])
def test_traced_exact_attention_quarantines_non_finite_inputs_as_eager(causal: bool, padded: bool) -> None:
    """Exact attention under ``torch.compile(fullgraph=True)`` (no value read back: the
    quarantine's masks always) against eager: the same NaN rows (a poisoned key reaches
    only the rows that see it), the same finite outputs and gradients. The control: the
    eager call reads values back (graph breaks), the traced one does not."""
    est = ka.create("softmax").double()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 4, generator=g, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        k[0, 1, 7] = float("nan")
        v[1, 0, 3, 2] = float("inf")
        q[1, 1, 5] = float("nan")
    mask = None
    if padded:
        mask = torch.zeros(2, 12, dtype=torch.bool)
        mask[1, 3] = True  # pads the inf value: no row may see it
        mask[0, 10:] = True
    compiled = torch.compile(
        lambda q, k, v: est(q, k, v, causal=causal, key_padding_mask=mask), fullgraph=True, backend="aot_eager"
    )
    outs, grads = [], []
    for fn in (lambda q, k, v: est(q, k, v, causal=causal, key_padding_mask=mask), compiled):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(qq, kk, vv)
        keep = ~out.isnan()
        torch.where(keep, out, 0).square().sum().backward()
        outs.append(out.detach())
        grads.append([t.grad for t in (qq, kk, vv)])
    assert torch.equal(outs[0].isnan(), outs[1].isnan())
    bad = outs[0].isnan().any(-1)
    assert bool(bad.any()) and not bool(bad.all())  # some rows poisoned, not all
    if causal and not padded:
        assert not bool(bad[0, 1, :7].any()) and bool(bad[0, 1, 7:].all())  # the NaN key: its row and later only
    keep = ~outs[0].isnan()
    torch.testing.assert_close(outs[1][keep], outs[0][keep], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads[1], grads[0], strict=True):
        assert torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, equal_nan=True)
    dynamo.reset()
    report = dynamo.explain(lambda q: est(q, k, v, causal=causal, key_padding_mask=mask))(q)
    assert report.graph_break_count == 0
    dynamo.reset()


def test_traced_exact_attention_without_its_quarantine_leaks_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control of the test above: with the traced quarantine taken out, a NaN
    key at position 7 sends NaN into the gradients of the earlier rows' queries (the
    outputs of those rows stay finite: the loss reads only them)."""
    from kernelattn_core.builtins import estimators

    est = ka.create("softmax").double()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 12, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k[0, 0, 7] = float("nan")

    def early_query_grads(fn) -> torch.Tensor:  # type: ignore[no-untyped-def]
        qq = q.clone().requires_grad_()
        out = fn(qq, k, v)
        out[0, 0, :7].square().sum().backward()
        assert not bool(out[0, 0, :7].isnan().any())
        return qq.grad[0, 0, :7]

    assert bool(torch.isfinite(early_query_grads(lambda q, k, v: est(q, k, v, causal=True))).all())
    monkeypatch.setattr(
        estimators, "quarantine_traced", lambda q, k, v, causal: (q, k, v, torch.zeros(q.shape[:-1], dtype=torch.bool))
    )
    fn = torch.compile(lambda q, k, v: est(q, k, v, causal=True), fullgraph=True, backend="aot_eager")
    leaked = early_query_grads(fn)
    dynamo.reset()
    assert bool(leaked.isnan().any())


@pytest.mark.parametrize(("n", "m", "causal"), [(9, 9, True), (6, 9, True), (9, 5, True), (9, 7, False)])
def test_traced_quarantine_poisons_the_rows_of_the_pair_mask(n: int, m: int, causal: bool) -> None:
    """:func:`quarantine_traced` (no ``[N, M]`` pair mask) against :func:`quarantine_non_finite`
    with :func:`allowed_pairs`: the same cleaned inputs and the same poisoned rows."""
    from kernelattn_core.engine.naive import allowed_pairs, quarantine_non_finite, quarantine_traced

    g = torch.Generator().manual_seed(n * m)
    q, k, v = torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, m, 4, generator=g), torch.randn(2, 3, m, 5)
    q[0, 1, 2, 0] = float("nan")
    k[1, 2, m // 2, 3] = float("inf")
    v[0, 0, m - 1, 1] = float("nan")
    v[1, 1, 1, 0] = float("-inf")
    ref = quarantine_non_finite(q, k, v, allowed_pairs(n, m, causal, None, q.device))
    got = quarantine_traced(q, k, v, causal)
    for a, b in zip(got[:3], ref[:3], strict=True):
        assert torch.equal(a, b)
    assert ref[3] is not None and torch.equal(got[3], ref[3])
    assert 0 < int(got[3].sum()) < got[3].numel()
