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


@pytest.mark.parametrize("name", ["prf", "hedgehog", "elu", "sliding-window"])
def test_an_estimator_made_and_called_under_inference_mode_works(name: str) -> None:
    """Made under ``torch.inference_mode()`` (its build counter an inference tensor), the
    first call failed: the build runs outside inference mode to make normal tensors and
    updated that counter in place ("Inplace update to inference tensor outside
    InferenceMode"). Outputs and a decode equal those of the same estimator made normally;
    the decoding short path of sliding-window, which keeps the versions of a state's flags,
    runs on flags that keep none."""
    opts = {"seed": 0} if name in ("prf",) else {}
    if name == "sliding-window":
        opts = {"window": 4, "num_features": 8}
    q, k, v = (torch.randn(1, 2, 12, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    outs = []
    for inference in (True, False):
        torch.manual_seed(0)
        with torch.inference_mode(inference):
            est = ka.create(name, **opts).eval()
            full = est(q, k, v, causal=True)
            out, state = est.step(q[:, :, :6], k[:, :, :6], v[:, :, :6])
            rows = [out]
            for t in range(6, 12):
                out, state = est.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
                rows.append(out)
        outs.append((full.clone(), torch.cat(rows, 2).clone()))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[0][1], outs[0][0], rtol=1e-5, atol=1e-6)  # the decode is the forward's rows


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


def _step_inputs(step: int) -> list[torch.Tensor]:
    """The two inputs of a step (seeded by the step), requiring gradients."""
    gens = [torch.Generator().manual_seed(10 * step + i) for i in range(2)]
    return [torch.randn(2, 6, 16, dtype=torch.float64, generator=g).requires_grad_() for g in gens]


def _after_step(m: torch.nn.Module, xs: list[torch.Tensor]) -> tuple:
    """(input gradients, parameter gradients, estimator state) after a step."""
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    state = {k: t.clone() for k, t in m.estimator.state_dict().items() if torch.is_tensor(t)}
    return [x.grad.clone() for x in xs if x.grad is not None], grads, state


def _two_calls(name: str, opts: dict[str, object], reentrant: bool | None, order: str) -> list[tuple]:
    """Two steps, each with two training calls of one layer before the backward pass:
    ``"sum"`` (two inputs, one loss), ``"tied"`` (the layer applied to its own output) or
    ``"fifo"`` (two inputs, the first call's loss backpropagated first). Checkpointed when
    ``reentrant`` is given."""
    m = _model(name, opts)
    record = []
    for step in range(2):
        xs = _step_inputs(step)
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
        record.append(_after_step(m, xs))
    return record


def _assert_same_steps(plain, ckpt) -> None:  # type: ignore[no-untyped-def]
    """Per step: input and parameter gradients within float64 rounding, and the
    estimator's state after the step identical."""
    for step, ((x0, g0, s0), (x1, g1, s1)) in enumerate(zip(plain, ckpt)):
        assert g1.keys() == g0.keys() and len(x1) == len(x0)
        pairs = [(f"input {i} grad", a, b) for i, (a, b) in enumerate(zip(x1, x0))]
        pairs += [(k, g1[k], g0[k]) for k in g0]
        for what, got, want in pairs:
            close = torch.allclose(got, want, rtol=1e-9, atol=1e-12)
            assert close, f"step {step} {what}: max diff {float((got - want).abs().max()):.3g}"
        differ = [k for k in s0 if not torch.equal(s0[k], s1[k])]
        assert not differ, f"step {step}: estimator state differs after the checkpointed step: {differ}"


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
    _assert_same_steps(plain, ckpt)


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


# --------------------------------------------------------------------------- several calls, one checkpoint
#: (estimator, options): random estimators, and ``redraw_every=0`` (fixed draws: the control)
IN_ONE = [TWICE[0], ("prf", {"num_features": 8, "redraw_every": 0}), *TWICE[1:]]


class _Half(torch.nn.Module):
    """``m(t)[0] * 0.5``: the layer as a module (``checkpoint_sequential`` takes modules)."""

    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.m(t)[0] * 0.5


def _in_one_checkpoint(name: str, opts: dict[str, object], reentrant: bool | None, form: str) -> list[tuple]:
    """Two steps, each calling one layer twice inside ONE checkpoint (when ``reentrant`` is
    given): ``"tied"`` (the layer on its own output), ``"sequential"``
    (``checkpoint_sequential`` over ``nn.Sequential(layer, layer)``, one segment) or
    ``"two-outputs"`` (two inputs, two outputs, each loss backpropagated on its own: two
    backward passes recompute the same checkpoint)."""
    from torch.utils.checkpoint import checkpoint_sequential

    m = _model(name, opts)
    half = _Half(m)
    record = []
    for step in range(2):
        xs = _step_inputs(step)
        m.zero_grad()
        if form == "tied":

            def block(t: torch.Tensor) -> torch.Tensor:
                return half(half(t))

            out = block(xs[0]) if reentrant is None else checkpoint(block, xs[0], use_reentrant=reentrant)
            out.square().sum().backward()
        elif form == "sequential":
            # a list: nn.Sequential(half, half).children() holds the layer once; the first
            # of the two segments (both calls) is checkpointed, the last runs plainly
            fns = [half, half, torch.nn.Identity(), torch.nn.Identity()]
            seq = torch.nn.Sequential(*fns)
            out = seq(xs[0]) if reentrant is None else checkpoint_sequential(fns, 2, xs[0], use_reentrant=reentrant)
            out.square().sum().backward()
        else:

            def pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return half(a), half(b)

            o1, o2 = pair(*xs) if reentrant is None else checkpoint(pair, *xs, use_reentrant=reentrant)
            o1.square().sum().backward(retain_graph=True)
            o2.square().sum().backward()
        record.append(_after_step(m, xs))
    return record


@pytest.mark.parametrize("form", ["tied", "sequential", "two-outputs"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize(("name", "opts"), IN_ONE, ids=[f"{n}-{o}" for n, o in IN_ONE])
def test_one_layer_called_twice_inside_one_checkpoint_has_the_plain_gradients(name, opts, reentrant, form) -> None:
    """Both calls of a weight-tied layer inside one checkpoint share its token: the second
    call's record replaced the first's, whose recompute then used the second call's
    draws (q_proj grad off 0.005-0.03, silently). The calls are kept in call order and
    the recompute takes them in that order, counted anew in every backward pass (two
    backward passes recomputing the same checkpoint, ``"two-outputs"``). With fixed
    draws (``redraw_every=0``, the control) the gradients were right before too."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    plain = _in_one_checkpoint(name, opts, None, form)
    ckpt = _in_one_checkpoint(name, opts, reentrant, form)
    _assert_same_steps(plain, ckpt)


def test_a_recompute_running_more_calls_than_recorded_raises() -> None:
    """The calls inside one checkpoint are matched by their order: a recompute that runs
    the layer more often than the forward pass did (control flow on state) cannot be
    matched and raises ``ReplayError`` naming the case, never takes another call's draws."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    m = _model("prf", {"num_features": 8, "redraw_every": 1})
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    runs = []

    def block(t: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        for _ in range(2 if len(runs) == 1 else 3):  # the recompute calls the layer once more
            t = m(t)[0] * 0.5
        return t

    # reentrant: its recompute runs the whole block (a non-reentrant one stops once it has
    # recomputed what the forward pass saved)
    out = checkpoint(block, x, use_reentrant=True)
    with pytest.raises(redraw.ReplayError, match="called 2 times with different random draws inside one"):
        out.square().sum().backward()


# --------------------------------------------------------------------------- nested checkpoints
NESTED = [
    ("prf", {"num_features": 8, "redraw_every": 1}),
    ("ra", {"num_features": 4}),
    ("rfa-snis", {"num_features": 8}),
    ("cexp", {"num_features": 8}),
]


def _nested(name: str, opts: dict[str, object], outer: bool | None, inner: bool | None, depth: int) -> torch.Tensor:
    """The q_proj gradient of two blocks before one backward pass, each block a checkpoint
    (``use_reentrant=outer``) around ``depth`` nested checkpoints (``use_reentrant=inner``)
    around the layer called twice; plain when ``outer`` is ``None``."""
    m = _model(name, opts)
    xs = [
        torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i), requires_grad=True)
        for i in range(2)
    ]

    def layer(t: torch.Tensor) -> torch.Tensor:
        t = m(t)[0] * 0.5
        return m(t)[0] * 0.5

    def level(t: torch.Tensor, d: int) -> torch.Tensor:
        t = t * 1.0
        if d == 0 or outer is None:
            return layer(t)
        return checkpoint(level, t, d - 1, use_reentrant=inner)

    def block(t: torch.Tensor) -> torch.Tensor:
        return level(t, depth)

    outs = [block(x) if outer is None else checkpoint(block, x, use_reentrant=outer) for x in xs]
    sum(o.square().sum() for o in outs).backward()
    return m.q_proj.weight.grad.clone()


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize(("name", "opts"), NESTED, ids=[f"{n}-{o}" for n, o in NESTED])
def test_reentrant_checkpoints_nested_in_a_reentrant_one_have_the_plain_gradients(name, opts, depth) -> None:
    """A reentrant checkpoint nested in a reentrant one, two blocks before one backward
    pass: the call was recorded under the inner checkpoint, freed at once under the outer
    one's ``no_grad`` forward, so its recompute was unmatched with nothing pending and
    silently took the last block's draws (q_proj off up to 2.4). The call is now
    recorded under the outermost checkpoint, the outer recompute replays it and records
    what it replayed under the inner checkpoints it runs again, whose recomputes follow."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    want = _nested(name, opts, None, None, depth)
    got = _nested(name, opts, True, True, depth)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("outer", "inner"), [(False, True), (True, False)])
def test_mixed_nested_checkpoints_with_two_blocks_raise(outer, inner) -> None:
    """Mixed nestings (reentrant in non-reentrant and the reverse) cannot be matched:
    ``ReplayError``, never another block's draws (the control for the test above)."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    with pytest.raises(redraw.ReplayError, match="could not be matched"):
        _nested("prf", {"num_features": 8, "redraw_every": 1}, outer, inner, 1)


# --------------------------------------------------------------------------- a backward pass that raises
def _feature_buffers(m: ka.KernelAttention) -> dict[str, torch.Tensor]:
    fm = m.estimator.features if hasattr(m.estimator, "features") else m.estimator.feature_map
    return {k: t.clone() for k, t in fm.state_dict().items() if t.is_floating_point()}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize(
    ("name", "opts"),
    [
        ("prf", {"num_features": 8, "redraw_every": 1}),
        ("cexp", {"num_features": 8, "redraw_every": 1}),
        ("rfa-snis", {"num_features": 8}),
    ],
)
def test_a_backward_pass_that_raises_leaves_the_last_calls_draws(name, opts, reentrant) -> None:
    """Two checkpointed calls, then a backward pass that raises after the first call's
    recompute (a gradient hook, as a non-finite guard): the last call's draws were put
    back only at the end of the backward pass, which never came, so the map kept the
    first call's draws (omega off up to 3.3; cexp's A, rfa-snis' samples too) and a later
    ``load_state_dict`` was overwritten by the stale restore at the next training call.
    They are put back right after the recompute's computation now, and loading drops any
    restore still pending."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    m = _model(name, opts)
    xs = [
        torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i), requires_grad=True)
        for i in range(2)
    ]

    def guard(g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("non-finite gradient guard")

    xs[0].register_hook(guard)
    o1 = checkpoint(lambda t: m(t)[0], xs[0], use_reentrant=reentrant)
    o2 = checkpoint(lambda t: m(t)[0], xs[1], use_reentrant=reentrant)
    last = _feature_buffers(m)
    with pytest.raises(RuntimeError, match="non-finite gradient guard"):
        (o1.square().sum() + o2.square().sum()).backward()
    now = _feature_buffers(m)
    assert now.keys() == last.keys()
    differ = {k: float((now[k] - last[k]).abs().max()) for k in now if not torch.equal(now[k], last[k])}
    assert not differ, f"the map holds another call's draws after the failed backward pass: {differ}"
    policy = getattr(m.estimator, "redraw_policy", None)
    assert policy is None or policy._latest is None
    if policy is None:  # rfa-snis draws at every training call: nothing to keep across one
        return
    # recovery: load a state with recognisable draws, no redraw due at the next call
    sd = {k: t.clone() for k, t in m.state_dict().items()}
    drawn = [k for k in sd if k.rsplit(".", 1)[-1] == "omega"]
    assert drawn
    for k in drawn:
        sd[k] = torch.full_like(sd[k], 0.125)
    sd["estimator.redraw_policy.step"] = torch.tensor(0)
    del o1, o2
    m.load_state_dict(sd)
    m(torch.randn(2, 6, 16, dtype=torch.float64))
    after = m.state_dict()
    assert all(torch.all(after[k] == 0.125) for k in drawn), "the loaded draws were overwritten"


def test_load_state_dict_drops_a_pending_restore() -> None:
    """A restore still pending from a recompute (a caller that does not end its replay,
    and a backward pass that raised) never overwrites loaded draws."""
    m = _model("prf", {"num_features": 8, "redraw_every": 1})
    m(torch.randn(2, 6, 16, dtype=torch.float64))
    policy, fm = m.estimator.redraw_policy, m.estimator.feature_map
    stale = redraw.MapState(fm)
    redraw.MapState.detach_from(fm)  # the map shows other tensors, the stale restore is pending
    policy._latest = stale
    sd = {k: t.clone() for k, t in m.state_dict().items()}
    sd["estimator.feature_map.omega"] = torch.full_like(sd["estimator.feature_map.omega"], 0.125)
    sd["estimator.redraw_policy.step"] = torch.tensor(0)
    m.load_state_dict(sd)
    assert policy._latest is None
    m(torch.randn(2, 6, 16, dtype=torch.float64))
    assert torch.all(fm.omega == 0.125)


@pytest.mark.parametrize("causal", [False, True])
def test_a_weights_override_holds_with_gradients_on(causal: bool) -> None:
    """rmfa's documented ``weights`` override (negative controls) is used by a call with
    gradients on as by one under no_grad, and stays set: the grouped engine keeps the
    map's integer buffers by reference (a clone of ``degrees`` looked like a new draw to
    the map's cache, which dropped the override silently)."""
    torch.manual_seed(0)
    est = ka.create("rmfa", num_features=16, seed=0, redraw_every=0).double().eval()
    q, k, v = (0.3 * torch.randn(1, 2, 40, 8, dtype=torch.float64) for _ in range(3))
    plain = ka.kernel_attention(q, k, v, est, causal=causal)
    fm = est.feature_map
    override = fm.weights * torch.linspace(0.2, 3.0, fm.weights.numel(), dtype=torch.float64)
    fm.weights = override
    with torch.no_grad():
        without_grad = ka.kernel_attention(q, k, v, est, causal=causal)
    qg = q.clone().requires_grad_()
    with_grad = ka.kernel_attention(qg, k, v, est, causal=causal)
    assert float((without_grad - plain).abs().max()) > 1e-3  # the override changes the output
    torch.testing.assert_close(with_grad.detach(), without_grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fm.weights, override)
