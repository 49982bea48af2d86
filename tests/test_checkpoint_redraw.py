"""Activation checkpointing around random estimators gives the gradients of the forward
pass that made the output.

``torch.utils.checkpoint.checkpoint`` runs a layer's forward again during the backward
pass. That recompute must not advance a redraw schedule, a sample counter or a running
statistic, and must use exactly the draws of the forward pass it replays: otherwise the
gradient belongs to other features (``prf`` with ``redraw_every=1``, ``ra``,
``rfa-snis``), data-adapted maps count batches twice (``cexp``), and maps whose draw
changes shape (``rmfa``) make torch raise ``CheckpointError``.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import kernelattn_core as ka
from kernelattn_core import redraw

STEPS = 3

#: (estimator, options, causal)
CASES = [
    ("prf", {"num_features": 8, "redraw_every": 1}, False),
    ("prf", {"num_features": 8, "redraw_every": 2}, True),
    ("ra", {"num_features": 4}, False),
    ("ra", {"num_features": 4}, True),
    ("ra-biased", {"num_features": 4}, False),
    ("rfa-snis", {"num_features": 8}, False),
    ("rfa-snis", {"num_features": 8}, True),
    ("lara", {"num_features": 4}, False),
    ("cexp", {"num_features": 8, "redraw_every": 1}, False),
    ("cexp", {"num_features": 8, "use_batch_stats": False}, False),
    ("hcexp", {"num_features": 8}, True),
    ("rmfa", {"num_features": 8, "redraw_every": 1}, False),
    ("schoenbat", {"num_features": 8, "redraw_every": 1}, False),
]


def _model(name: str, opts: dict[str, object]) -> ka.KernelAttention:
    torch.manual_seed(0)
    return ka.KernelAttention(16, 2, estimator=name, batch_first=True, seed=1, **opts).double().train()


def _steps(name: str, opts: dict[str, object], causal: bool, reentrant: bool | None) -> list[tuple]:
    """Outputs, every parameter's gradient and the estimator's state after each of
    ``STEPS`` training steps, checkpointed (``reentrant`` given) or plain (``None``)."""
    m = _model(name, opts)
    record = []
    for i in range(STEPS):
        x = torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        x.requires_grad_()  # the reentrant form needs an input that requires a gradient
        m.zero_grad()

        def layer(t: torch.Tensor) -> torch.Tensor:
            return m(t, is_causal=causal)[0] if causal else m(t)[0]

        out = layer(x) if reentrant is None else checkpoint(layer, x, use_reentrant=reentrant)
        out.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        state = {k: t.clone() for k, t in m.estimator.state_dict().items() if torch.is_tensor(t)}
        record.append((out.detach().clone(), x.grad.clone(), grads, state))
    return record


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize(("name", "opts", "causal"), CASES, ids=[f"{n}-{o}-causal={c}" for n, o, c in CASES])
def test_checkpointed_training_step_has_the_plain_step_gradients(name, opts, causal, reentrant) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    plain = _steps(name, opts, causal, None)
    ckpt = _steps(name, opts, causal, reentrant)
    for step, ((o0, x0, g0, s0), (o1, x1, g1, s1)) in enumerate(zip(plain, ckpt)):
        pairs = [("output", o1, o0), ("input grad", x1, x0)] + [(k, g1[k], g0[k]) for k in g0]
        assert g1.keys() == g0.keys()
        for what, got, want in pairs:
            close = torch.allclose(got, want, rtol=1e-6, atol=1e-12)
            assert close, f"step {step} {what}: max diff {float((got - want).abs().max()):.3g}"
        assert s1.keys() == s0.keys()
        differ = [k for k in s0 if not torch.equal(s0[k], s1[k])]
        assert not differ, f"step {step}: estimator state differs after the checkpointed step: {differ}"


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_one_checkpointed_step_advances_the_schedule_once(reentrant) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    x = torch.randn(2, 6, 16, requires_grad=True)
    for name, opts, counter in (
        ("prf", {"num_features": 8, "redraw_every": 1000}, lambda e: e.redraw_policy.step),
        ("cexp", {"num_features": 8}, lambda e: e.feature_map.num_batches_tracked),
        ("ra", {"num_features": 4}, lambda e: e.draws.calls),
        ("rfa-snis", {"num_features": 8}, lambda e: e.draws.calls),
    ):
        m = ka.KernelAttention(16, 2, estimator=name, batch_first=True, seed=1, **opts).train()
        checkpoint(lambda t, m=m: m(t)[0], x, use_reentrant=reentrant).sum().backward()
        assert int(counter(m.estimator)) == 1, f"{name}: {int(counter(m.estimator))} after one checkpointed step"


def test_explicit_generator_is_replayed_by_the_recompute() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    results = []
    for use in (False, True):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(7)
        m = ka.KernelAttention(16, 2, estimator="ra", batch_first=True, num_features=4, generator=g).double()
        x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
        out = checkpoint(lambda t, m=m: m(t)[0], x, use_reentrant=False) if use else m(x)[0]
        out.square().sum().backward()
        results.append((m.q_proj.weight.grad.clone(), g.get_state()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-12)
    assert torch.equal(results[1][1], results[0][1]), "the recompute consumed the explicit generator again"


def test_recompute_detection() -> None:
    assert not redraw.recomputing()
    seen = []

    def f(t: torch.Tensor) -> torch.Tensor:
        seen.append(redraw.recomputing())
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    for reentrant in (False, True):
        seen.clear()
        checkpoint(f, x, use_reentrant=reentrant).sum().backward()
        assert seen == [False, True], (reentrant, seen)


def test_recompute_detection_falls_back_without_the_private_hook(monkeypatch) -> None:
    seen = []
    x = torch.randn(3, requires_grad=True)
    x.register_hook(lambda g: seen.append(redraw.recomputing()))  # runs inside the backward pass
    x.sin().sum().backward()
    monkeypatch.delattr(torch._C, "_current_graph_task_id", raising=False)
    x.sin().sum().backward()
    assert seen == [True, False]  # without the hook: every forward counts, as before the check


@pytest.mark.parametrize("name", ["prf", "cexp", "gmm-prf", "rfa-snis"])
def test_a_map_first_built_under_inference_mode_trains_afterwards(name: str) -> None:
    """A map built lazily by its first call under ``torch.inference_mode()`` got
    inference-tensor buffers, and the next training step failed ("Inference tensors cannot
    be saved for backward" / "Inplace update to inference tensor")."""
    torch.manual_seed(0)
    est = ka.create(name, num_features=8, seed=0).train()  # no head_dim: built by the first call
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    with torch.inference_mode():
        est(q, k, v)
    assert not any(t.is_inference() for t in (*est.parameters(), *est.buffers()))
    qg = q.clone().requires_grad_()
    est(qg, k, v).square().sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["prf", "hedgehog"])
def test_a_checkpointed_feature_map_layer_is_recomputed_once(name: str, causal: bool) -> None:
    """Under a non-reentrant checkpoint a one-group call no longer holds its local graph
    (packed by the checkpoint's hooks, its unpacking in the backward re-ran the forward
    three times): one forward and one recompute per step, with the plain step's gradients."""
    torch.manual_seed(0)
    m = ka.KernelAttention(16, 2, estimator=name, batch_first=True, num_features=8, seed=1, causal=causal)
    calls = [0]
    m.estimator.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    x = torch.randn(2, 6, 16)
    checkpoint(lambda t: m(t)[0], x, use_reentrant=False).square().sum().backward()
    assert calls[0] == 2
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m(x)[0].square().sum().backward()
    for a, p in zip(grads, m.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- several calls, one backward
#: (estimator, options): every random estimator whose recompute replays draws or statistics
TWICE = [
    ("prf", {"num_features": 8, "redraw_every": 1}),
    ("ra", {"num_features": 4}),
    ("rfa-snis", {"num_features": 8}),
    ("cexp", {"num_features": 8}),
    ("cexp", {"num_features": 8, "redraw_every": 1}),
    ("rmfa", {"num_features": 8, "redraw_every": 1}),
    ("schoenbat", {"num_features": 8, "redraw_every": 1}),
]


def _two_calls(name: str, opts: dict[str, object], reentrant: bool | None, order: str) -> list[tuple]:
    """Two steps, each with two training calls of one layer before the backward pass:
    ``"sum"`` (two inputs, one loss), ``"tied"`` (the layer applied to its own output) or
    ``"fifo"`` (two inputs, the first call's loss backpropagated first). Checkpointed when
    ``reentrant`` is given."""
    m = _model(name, opts)
    record = []
    for step in range(2):
        xs = [
            torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + i))
            for i in range(2)
        ]
        for x in xs:
            x.requires_grad_()
        m.zero_grad()

        def layer(t: torch.Tensor) -> torch.Tensor:
            out = m(t)[0]
            return out if order != "tied" else out * 0.5  # keeps the second call's inputs moderate

        def call(t: torch.Tensor) -> torch.Tensor:
            return layer(t) if reentrant is None else checkpoint(layer, t, use_reentrant=reentrant)

        if order == "tied":
            call(call(xs[0])).square().sum().backward()
        else:
            o1, o2 = call(xs[0]), call(xs[1])
            if order == "sum":
                (o1.square().sum() + o2.square().sum()).backward()
            else:
                o1.square().sum().backward()
                o2.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        state = {k: t.clone() for k, t in m.estimator.state_dict().items() if torch.is_tensor(t)}
        inputs = [x.grad.clone() for x in xs if x.grad is not None]
        record.append((inputs, grads, state))
    return record


@pytest.mark.parametrize("order", ["sum", "tied", "fifo"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize(("name", "opts"), TWICE, ids=[f"{n}-{o}" for n, o in TWICE])
def test_two_checkpointed_calls_before_one_backward_have_the_plain_gradients(name, opts, reentrant, order) -> None:
    """One layer called twice (two inputs, a weight-tied layer on its own output) before
    the backward pass: each recompute uses the draws and statistics of the call it
    recomputes, whatever order the backward pass takes, and the estimator's state after
    the step is the plain step's (the last call's draws)."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    plain = _two_calls(name, opts, None, order)
    ckpt = _two_calls(name, opts, reentrant, order)
    for step, ((x0, g0, s0), (x1, g1, s1)) in enumerate(zip(plain, ckpt)):
        assert g1.keys() == g0.keys() and len(x1) == len(x0)
        pairs = [(f"input {i} grad", a, b) for i, (a, b) in enumerate(zip(x1, x0))]
        pairs += [(k, g1[k], g0[k]) for k in g0]
        for what, got, want in pairs:
            close = torch.allclose(got, want, rtol=1e-9, atol=1e-12)
            assert close, f"step {step} {what}: max diff {float((got - want).abs().max()):.3g}"
        differ = [k for k in s0 if not torch.equal(s0[k], s1[k])]
        assert not differ, f"step {step}: estimator state differs after the checkpointed step: {differ}"


@pytest.mark.parametrize(
    ("name", "opts"), [("ra", {"num_features": 4}), ("prf", {"num_features": 8, "redraw_every": 1})]
)
def test_an_unmatched_recompute_with_other_pending_draws_raises(name, opts) -> None:
    """Nested checkpoints: the outer recompute runs the inner calls again under new
    checkpoints, which cannot be matched to their original calls. With two calls of the
    layer pending with different draws that is refused (``ReplayError``) instead of
    giving the gradient of the other call's draws; with one call (the negative control)
    the last call's draws are the right ones and the gradients are the plain step's."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")

    def run(calls: int, nested: bool) -> torch.Tensor:
        m = _model(name, opts)
        x = torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        x.requires_grad_()

        def layer(t: torch.Tensor) -> torch.Tensor:
            return m(t)[0] * 0.5

        def block(t: torch.Tensor) -> torch.Tensor:
            for _ in range(calls):
                t = checkpoint(layer, t, use_reentrant=False) if nested else layer(t)
            return t

        out = checkpoint(block, x, use_reentrant=False) if nested else block(x)
        out.square().sum().backward()
        return m.q_proj.weight.grad.clone()

    with pytest.raises(redraw.ReplayError, match="could not be matched"):
        run(2, nested=True)
    torch.testing.assert_close(run(1, nested=True), run(1, nested=False), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_pending_draws_do_not_accumulate_across_steps(reentrant) -> None:
    """A checkpointed call's record lives as long as its checkpoint's graph: after many
    steps (two checkpointed calls each, and a training-mode validation call under
    ``torch.no_grad()``) nothing is left once the outputs are gone, and no replayed draw
    is left in the map."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for name, opts, pendings in (
        ("prf", {"num_features": 8, "redraw_every": 1}, lambda e: [e.redraw_policy._pending]),
        ("cexp", {"num_features": 8, "redraw_every": 1}, lambda e: [e.redraw_policy._pending, e.feature_map._adapted]),
        ("ra", {"num_features": 4}, lambda e: [e.draws._pending]),
        ("rfa-snis", {"num_features": 8}, lambda e: [e.draws._pending]),
    ):
        m = _model(name, opts)
        x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
        for _ in range(20):
            outs = [checkpoint(lambda t, m=m: m(t)[0], x, use_reentrant=reentrant) for _ in range(2)]
            assert max(len(p) for p in pendings(m.estimator)) == 2
            sum(o.square().sum() for o in outs).backward()
            with torch.no_grad():
                m(x)
            del outs
        assert [len(p) for p in pendings(m.estimator)] == [0] * len(pendings(m.estimator)), name
        assert [len(p._items) for p in pendings(m.estimator)] == [0] * len(pendings(m.estimator)), name
        policy = getattr(m.estimator, "redraw_policy", None)
        assert policy is None or policy._latest is None


def test_plain_calls_record_nothing() -> None:
    """Outside a checkpoint (gradients on, no saved-tensor hooks; a validation call under
    ``torch.no_grad()``) no call is identified and nothing is recorded."""
    m = _model("ra", {"num_features": 4})
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    m(x)[0].sum().backward()
    with torch.no_grad():
        m(x)
    assert redraw.checkpoint_token() is None
    assert len(m.estimator.draws._pending._items) == 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hooks", ["several-groups", "save_on_cpu"])
@pytest.mark.parametrize(
    ("name", "opts"),
    [
        ("rmfa", {"num_features": 8, "redraw_every": 1}),
        ("schoenbat", {"num_features": 8, "redraw_every": 1}),
        ("prf", {"num_features": 8, "redraw_every": 1}),
    ],
)
def test_two_calls_before_one_backward_recompute_with_their_own_draws(name, opts, hooks, causal, monkeypatch) -> None:
    """The grouped engine recomputes a call's features in the backward pass (several
    groups, or one group under saved-tensor hooks such as ``save_on_cpu``) with the map's
    buffers as that call's forward pass saw them -- all of them: rmfa's and schoenbat's
    integer ``degrees`` were left out, so with a redraw between two calls before one
    backward the first call's gradients used the second call's degrees (q_proj off by up
    to 800, silently). The reference backpropagates each call before the next (the same
    draws: the schedule advances per call)."""
    from kernelattn_core.engine import grouped

    if hooks == "several-groups":
        monkeypatch.setattr(grouped, "GROUP_BYTES", 2 * 2 * 16 * 8 * 64)  # 64-position groups

    def grads(together: bool):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        m = ka.KernelAttention(16, 2, estimator=name, batch_first=True, seed=1, causal=causal, **opts).double()
        x1, x2 = (torch.randn(2, 200, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
        ctx = torch.autograd.graph.save_on_cpu() if hooks == "save_on_cpu" else contextlib.nullcontext()
        with ctx:
            if together:
                (m(x1)[0].square().sum() + m(x2)[0].square().sum()).backward()
            else:
                m(x1)[0].square().sum().backward()
                m(x2)[0].square().sum().backward()
        return m.q_proj.weight.grad, x1.grad, x2.grad

    for got, want in zip(grads(True), grads(False)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
