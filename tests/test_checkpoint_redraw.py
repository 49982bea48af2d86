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
