"""A model that compiles: ``torch.compile(fullgraph=True)`` traces feature-map estimators,
hedgehog and sliding-window as one graph, in training and in eval.

Under compilation the torch backend runs :mod:`kernelattn_core.engine.traced` (every
non-finite check a tensor operation, autograd's backward); here it is checked against the
eager engine (outputs and gradients, NaN/inf inputs and padding included), Dynamo's
``explain`` counts 0 graph breaks (the eager engine had 21 per ``prf`` forward: ``.item()``,
``bool(tensor)``, ``nonzero``), and a ``fullgraph=True`` compile (``aot_eager``: tracing
and autograd without code generation, cheap) trains like eager. CI cost: about 40 s on the
shared 2-core machine.
Compile time and the compiled step's speed are measured by ``scripts/decoder_goals.py``.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch._dynamo as dynamo

import kernelattn_core as ka
from kernelattn_core.engine.traced import traced_feature_attention
from kernelattn_core.errors import InputError
from kernelattn_core.interfaces import Normalizer

COMPILED = {
    "prf": {"num_features": 16, "seed": 0},
    "hedgehog": {"num_features": 16},
    "sliding-window": {"window": 4, "num_features": 16},
}


def _module(name: str, causal: bool) -> ka.KernelAttention:
    torch.manual_seed(0)
    return ka.KernelAttention(32, 4, name, causal=causal, batch_first=True, **COMPILED[name])


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_dynamo_traces_the_estimator_without_a_graph_break(name: str) -> None:
    x = torch.randn(2, 40, 32, requires_grad=True)
    pad = torch.zeros(2, 40, dtype=torch.bool)
    pad[1, 30:] = True
    for causal, training in ((True, True), (False, False)):
        module = _module(name, causal).train(training)

        def run(x: torch.Tensor, pad: torch.Tensor, module: ka.KernelAttention = module) -> torch.Tensor:
            return module(x, key_padding_mask=pad)[0]

        report = dynamo.explain(run)(x, pad)
        reasons = [b.reason.splitlines()[0] for b in report.break_reasons]
        assert report.graph_break_count == 0 and report.graph_count == 1, (causal, training, reasons)
        dynamo.reset()


@pytest.mark.parametrize(
    ("causal", "training", "heavy"),
    [(False, False, 0), (False, True, 0), (True, False, 0), (True, True, 0), (False, False, 5), (False, True, 5)],
)
def test_sliding_window_blocked_form_traces_without_a_graph_break_and_equals_eager(causal, training, heavy) -> None:
    """200 positions take the blocked form (the test above's 40 take the dense one): its
    non-causal kernel asked for storage pointers (whether the features alias the input) and
    broke the graph nine times; compiled, it never overwrites the features in place. With
    heavy keys too; the compiled module equals eager (outputs and gradients)."""
    torch.manual_seed(0)
    est = ka.create("sliding-window", window=4, num_features=8, global_tokens=1, heavy_keys=heavy, num_heads=2)
    est = est.train(training)
    q, k, v = (torch.randn(2, 2, 200, 16) for _ in range(3))
    pad = torch.zeros(2, 200, dtype=torch.bool)
    pad[1, :3] = True
    expected = est(q, k, v, key_padding_mask=pad, causal=causal)
    assert est.last_backend == "blocked"
    report = dynamo.explain(est)(q, k, v, key_padding_mask=pad, causal=causal)
    assert report.graph_break_count == 0, [b.reason.splitlines()[0] for b in report.break_reasons]
    dynamo.reset()
    compiled = torch.compile(est, fullgraph=True, backend="aot_eager")
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = compiled(*xs, key_padding_mask=pad, causal=causal)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), xs)
    ys = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(est(*ys, key_padding_mask=pad, causal=causal).square().sum(), ys)
    for a, b in zip(grads, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    dynamo.reset()


def test_the_eager_engine_does_break_the_graph() -> None:
    """The control: the eager engine itself, called directly, breaks on its checks."""
    from kernelattn_core.engine.grouped import grouped_feature_attention

    fm = _module("prf", True).estimator.feature_map
    x = torch.randn(2, 4, 40, 8)

    def run(x: torch.Tensor) -> torch.Tensor:
        return grouped_feature_attention(fm, x, x, x, causal=True, key_padding_mask=None)[0]

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, tracing an autograd.Function
        report = dynamo.explain(run)(x)
    assert report.graph_break_count > 0
    dynamo.reset()


@pytest.mark.parametrize("name", ["prf", "sliding-window"])
def test_a_fullgraph_compiled_training_step_equals_eager(name: str) -> None:
    eager, compiled_module = _module(name, True).train(), _module(name, True).train()
    compiled = torch.compile(compiled_module, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 40, 32)
    pad = torch.zeros(2, 40, dtype=torch.bool)
    pad[0, :3] = True
    outs = []
    for model in (eager, compiled):
        out, _ = model(x, key_padding_mask=pad)
        out.square().mean().backward()
        outs.append(out.detach())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    for (n, a), b in zip(eager.named_parameters(), compiled_module.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=n)
    dynamo.reset()


def test_a_compiled_layer_redrawing_between_two_calls_before_one_backward_equals_eager() -> None:
    """prf with ``redraw_every=1``, compiled, called twice before one backward pass: the
    redraw of the second call wrote into the buffer the first call's compiled graph had
    saved ("modified by an inplace operation" at backward). A redraw now writes into new
    tensors; the gradients equal eager's."""
    grads = []
    for compile_it in (False, True):
        dynamo.reset()
        torch.manual_seed(0)
        attn = ka.KernelAttention(16, 2, "prf", batch_first=True, seed=1, num_features=8, redraw_every=1).double()
        run = torch.compile(attn, backend="aot_eager") if compile_it else attn  # graph breaks at the redraw
        gen = torch.Generator().manual_seed(3)
        xs = [torch.randn(2, 6, 16, dtype=torch.float64, generator=gen) for _ in range(2)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Dynamo's own, at the graph break of the redraw
            for _ in range(2):  # two steps, two calls each
                attn.zero_grad()
                sum(run(x)[0].square().sum() for x in xs).backward()
        grads.append([p.grad.clone() for p in attn.parameters()])
    dynamo.reset()
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_fullgraph_with_a_redraw_schedule_is_refused_naming_it() -> None:
    """``redraw_every > 0`` is host work between training calls: ``fullgraph=True`` refuses
    it with a message naming the option and the ways out (it failed deep in Dynamo on a
    mapping proxy); without fullgraph the layer trains as eagerly, redraws included; with
    ``redraw_every=0`` the same layer compiles as one graph (the negative control)."""
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))
    for every in (2, 0):
        dynamo.reset()
        attn = ka.KernelAttention(16, 2, "prf", batch_first=True, seed=1, num_features=8, redraw_every=every)
        run = torch.compile(attn, fullgraph=True, backend="aot_eager")
        if every:
            with pytest.raises(dynamo.exc.Unsupported, match=r"redraw_every > 0 .* fullgraph=True use redraw_every=0"):
                run(x)
        else:
            run(x)[0].sum().backward()
    outs, draws = [], []
    for compile_it in (False, True):
        dynamo.reset()
        torch.manual_seed(0)  # the projections
        attn = ka.KernelAttention(16, 2, "prf", batch_first=True, seed=1, num_features=8, redraw_every=2).double()
        run = torch.compile(attn, backend="aot_eager") if compile_it else attn
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Dynamo's own, at the graph break of the schedule
            outs.append(torch.stack([run(x.double())[0] for _ in range(5)]))
        draws.append(attn.estimator.redraw_policy.draws)
    dynamo.reset()
    assert draws == [2, 2]  # calls 3 and 5 redrew, compiled or not
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-9, atol=1e-12)
    assert not torch.allclose(outs[0][0], outs[0][2])  # the redraws changed the rows


@pytest.mark.parametrize(
    ("name", "causal", "padded", "poisoned"),
    [
        (name, causal, padded, padded)
        for name, causal, padded in itertools.product(
            ["prf", "elu", "hedgehog", "rfa", "gmm-prf"], [True, False], [0, 1]
        )
    ]
    + [("prf", True, True, False), ("elu", False, False, True)],
)
def test_traced_form_equals_the_eager_engine(name: str, causal: bool, padded: bool, poisoned: bool) -> None:
    """The traced form run eagerly against the grouped engine: outputs, NaN rows and the
    gradients of the finite rows (float64, 37 positions, chunks of 8)."""
    opts = {"num_features": 8} | ({"seed": 0} if name in ("prf", "rfa", "gmm-prf") else {})
    est = ka.create(name, **opts).double().eval()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 37, w, generator=g, dtype=torch.float64).requires_grad_() for w in (4, 4, 3))
    mask = None
    if padded:
        mask = torch.zeros(2, 37, dtype=torch.bool)
        mask[0, :5] = True
        mask[1, 30:] = True
    qq, kk, vv = q, k, v
    if poisoned:
        qq, kk, vv = q.clone(), k.clone(), v.clone()
        with torch.no_grad():
            kk[0, 1, 20] = float("nan")
            qq[1, 0, 7] = float("inf")
            vv[1, 1, 31, 0] = float("nan")  # padded when padded
    ref = est(qq, kk, vv, causal=causal, key_padding_mask=mask)
    root = est._input_root(4)
    qs, ks = qq * root, kk * root
    if type(est.normalizer).pre is not Normalizer.pre:
        qs, ks = est.normalizer.pre(qs, ks)
    got = est._post(
        traced_feature_attention(
            est.feature_map, est.normalizer, qs, ks, vv, causal=causal, key_padding_mask=mask, chunk_size=8
        )
    )
    assert torch.equal(ref.isnan(), got.isnan())
    keep = ~ref.isnan()
    torch.testing.assert_close(got[keep], ref[keep], rtol=1e-10, atol=1e-12)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    g_ref = torch.autograd.grad((torch.where(keep, ref, 0) * w).sum(), (q, k, v))
    g_got = torch.autograd.grad((torch.where(keep, got, 0) * w).sum(), (q, k, v))
    for a, b in zip(g_got, g_ref):
        assert bool(torch.isfinite(a).all())
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------------- masks under compilation
def _float_padding(pad: torch.Tensor) -> torch.Tensor:
    """The additive float form ``0`` / ``-inf`` of a bool padding mask."""
    return torch.zeros(pad.shape).masked_fill(pad, float("-inf"))


def _mask_call(case: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The calls whose masks were read back to Python (``bool(tensor)``), which
    ``fullgraph=True`` refused: a converted encoder (its layers pass the padding mask in
    float form), a float ``key_padding_mask`` and the causal ``attn_mask`` of
    ``nn.Transformer``."""
    pad = torch.zeros(2, 24, dtype=torch.bool)
    pad[1, 18:] = True
    if case == "encoder":
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
        encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        return ka.convert_attention(encoder, "prf", num_features=16, seed=0).eval(), {"src_key_padding_mask": pad}
    attn = _module("prf", False).eval()
    if case == "float key_padding_mask":
        return attn, {"key_padding_mask": _float_padding(pad)}
    return attn, {"attn_mask": torch.nn.Transformer.generate_square_subsequent_mask(24)}


@pytest.mark.parametrize("case", ["encoder", "float key_padding_mask", "causal attn_mask"])
def test_masks_compile_as_one_graph_and_equal_eager(case: str) -> None:
    """``fullgraph=True``: one graph or an error (the masks' values are no longer read back)."""
    model, kwargs = _mask_call(case)
    x = torch.randn(2, 24, 32)

    def run(x: torch.Tensor) -> torch.Tensor:
        out = model(x, **kwargs)
        return out if isinstance(out, torch.Tensor) else out[0]

    with torch.no_grad():
        ref = run(x)
        got = torch.compile(run, fullgraph=True, backend="aot_eager")(x)  # a graph break raises
    if case == "causal attn_mask":  # read as causal, as eagerly
        assert not torch.allclose(ref, model(x)[0])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    dynamo.reset()


def test_a_mask_the_compiled_call_cannot_kernelize_is_still_refused() -> None:
    """Eagerly an InputError; compiled (no value may be read back) an assertion in the
    graph, with the same message, when the call runs."""
    attn = _module("prf", False).eval()
    x = torch.randn(2, 8, 32)
    bias = torch.zeros(2, 8)
    bias[1, 6:] = -1e4  # an additive bias, not 0 / -inf
    not_causal = torch.zeros(8, 8, dtype=torch.bool)
    not_causal[0, 5] = True
    compiled = torch.compile(lambda x, **kw: attn(x, **kw)[0], fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for kwargs, match in (
            ({"key_padding_mask": bias}, "key_padding_mask: a float mask must be additive"),
            ({"attn_mask": not_causal}, "attn_mask: only the causal mask"),
        ):
            with pytest.raises(ka.InputError, match=match):
                attn(x, **kwargs)
            with pytest.raises(RuntimeError, match=match):
                compiled(x, **kwargs)
    dynamo.reset()


def test_jit_trace_is_refused_naming_the_alternatives() -> None:
    """torch.jit.trace froze the engine's run-time decisions into the trace (a later input of
    another length crashed inside torch with 'unordered_map::at'); it is refused up front."""
    layer = ka.KernelAttention(32, 2, "prf", num_features=16, causal=True, batch_first=True).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's own warnings before the refusal
        with pytest.raises(InputError, match=r"torch\.jit\.trace: .*torch\.compile.*torch\.export\.export"):
            torch.jit.trace(layer, (torch.randn(2, 10, 32),))
    out, _ = layer(torch.randn(2, 10, 32))  # the same layer, untraced, runs
    assert out.shape == (2, 10, 32)


@pytest.mark.parametrize(("name", "causal"), [("prf", True), ("prf", False), ("hedgehog", True)])
def test_torch_export_at_a_fixed_length_equals_eager(name: str, causal: bool) -> None:
    """torch.export.export traces the estimator as one graph (the traced form): the exported
    program equals the eager layer on new inputs of the traced length, NaN rows included."""
    torch.manual_seed(0)
    layer = ka.KernelAttention(32, 2, name, num_features=16, causal=causal, batch_first=True).eval()
    program = torch.export.export(layer, (torch.randn(2, 12, 32),))
    y = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    y[1, 5, 3] = float("nan")  # causal: rows 5.. of batch 1 NaN; non-causal: all of batch 1
    got, want = program.module()(y)[0], layer(y)[0]
    assert torch.equal(got.isnan(), want.isnan()) and bool(want.isnan().any()) and not bool(want[0].isnan().any())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
    dynamo.reset()
