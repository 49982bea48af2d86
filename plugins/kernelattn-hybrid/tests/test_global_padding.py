"""sliding-window: the global tokens of a left-padded row are its first ``g`` keys after the
row's leading padding, not the absolute positions ``0 .. g - 1`` (which left padding, as
``generate()`` pads batched prompts, would mask away).

A row's output never depends on how much padding precedes it: the fast paths (dense and
blocked, causal and not) against the quadratic reference with per-row offsets (outputs and
gradients, float64), each left-padded row against the same sequence alone, the decoding
state (prefill, several positions, token by token, the finite short step) against the
forward, padding that is not a leading block (holes, right padding) as before, and the
negative control: the absolute positions give other rows. CI cost: a few seconds."""

from __future__ import annotations

import itertools

import pytest
import torch

import kernelattn_core as ka

F64 = torch.float64
LEADS = (0, 3, 1, 2)  # leading padded keys per row: different per row, one row without
N = 13  # blocks of 4: four blocks, so the non-causal far sums and the causal recurrence run


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64) * scale


def _est(window: int, glob: int, block: int | None, **options) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    options.setdefault("num_features", 8)
    est = ka.create("sliding-window", window=window, global_tokens=glob, block_size=block, seed=0, **options)
    return est.double()


def _left_mask(n: int, leads: tuple[int, ...] = LEADS) -> torch.Tensor:
    mask = torch.zeros(len(leads), n, dtype=torch.bool)
    for b, lead in enumerate(leads):
        mask[b, :lead] = True
    return mask


def _reference(est, q, k, v, causal, mask, offset):  # type: ignore[no-untyped-def]
    """The quadratic reference from the estimator's map, at the estimator's scale, with the
    global tokens at ``offset`` (``None``: the absolute positions ``0 .. g - 1``)."""
    from kernelattn_hybrid.naive import window_attention_naive

    root = est._input_root(q.shape[-1])
    qs, ks = q * root, k * root
    fm = est.feature_map
    fm.prepare(qs, ks, key_padding_mask=mask, causal=causal)
    return window_attention_naive(
        qs,
        ks,
        v,
        fm.raw_features(qs, query=True),
        fm.raw_features(ks, query=False),
        log_space=fm.log_space,
        window=est.window,
        global_tokens=est.global_tokens,
        causal=causal,
        key_padding_mask=mask,
        global_offset=offset,
    )


CASES = [
    (w, g, block, causal)
    for (w, g), block, causal in itertools.product([(0, 1), (2, 1), (3, 2), (1, 3)], [None, 4], [False, True])
]


@pytest.mark.parametrize(("window", "glob", "block", "causal"), CASES)
def test_fast_path_equals_the_reference_with_per_row_offsets(window, glob, block, causal):
    from kernelattn_hybrid.naive import leading_padding

    est = _est(window, glob, block, num_heads=2, head_dim=4)
    q, k, v = _rand(4, 2, N, 4, seed=1), _rand(4, 2, N, 4, seed=2), _rand(4, 2, N, 3, seed=3)
    mask = _left_mask(N)
    assert leading_padding(mask).tolist() == list(LEADS)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = est(*xs, causal=causal, key_padding_mask=mask)
    assert est.last_backend == ("dense" if block is None else "blocked")
    ys = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(est, *ys, causal, mask, leading_padding(mask))
    torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-12)
    w = _rand(4, 2, N, 3, seed=4)
    for a, b in zip(torch.autograd.grad((out * w).sum(), xs), torch.autograd.grad((ref * w).sum(), ys), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("window", "glob", "block", "causal"), CASES)
def test_left_padding_never_changes_a_row(window, glob, block, causal):
    """Each row of a left-padded batch (NaN and inf at its padded keys and values) equals the
    same sequence alone, outputs and gradients."""
    est = _est(window, glob, block)
    m = N - max(LEADS)
    rows = [
        (_rand(1, 2, m, 4, seed=10 + b), _rand(1, 2, m, 4, seed=20 + b), _rand(1, 2, m, 3, seed=30 + b))
        for b in range(4)
    ]
    q, k, v = (
        _rand(4, 2, N, 4, seed=5),
        torch.full((4, 2, N, 4), float("nan"), dtype=F64),
        torch.full((4, 2, N, 3), float("inf"), dtype=F64),
    )
    mask = torch.ones(4, N, dtype=torch.bool)
    for b, lead in enumerate(LEADS):  # the sequence after `lead` pads, right padding after it
        mask[b, lead : lead + m] = False
        for x, r in zip((q, k, v), rows[b], strict=True):
            x[b, :, lead : lead + m] = r[0]
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = est(*xs, causal=causal, key_padding_mask=mask)
    wt = _rand(4, 2, N, 3, seed=6)
    keep = ~mask[:, None, :, None]
    grads = torch.autograd.grad((out * wt).masked_fill(~keep, 0.0).sum(), xs)
    for b, lead in enumerate(LEADS):
        alone = [t.clone().requires_grad_() for t in rows[b]]
        ref = est(*alone, causal=causal)
        real = slice(lead, lead + m)
        torch.testing.assert_close(out[b : b + 1, :, real], ref, rtol=1e-11, atol=1e-12)
        ref_g = torch.autograd.grad((ref * wt[b : b + 1, :, real]).sum(), alone)
        for got, want in zip(grads, ref_g, strict=True):
            torch.testing.assert_close(got[b : b + 1, :, real], want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("window", "glob", "block", "causal"), CASES[::3])
def test_negative_control_absolute_positions_give_other_rows(window, glob, block, causal):
    """The old semantics (globals at 0 .. g - 1, masked in a left-padded row) is not what
    the estimator computes where a row is left-padded, and is where it is not."""
    est = _est(window, glob, block)
    q, k, v = _rand(4, 2, N, 4, seed=7, scale=2.0), _rand(4, 2, N, 4, seed=8, scale=2.0), _rand(4, 2, N, 3, seed=9)
    mask = _left_mask(N)
    with torch.no_grad():
        out = est(q, k, v, causal=causal, key_padding_mask=mask)
        old = _reference(est, q, k, v, causal, mask, None)
    real = ~mask[:, None, :, None]
    diff = ((out - old) * real).abs().amax((1, 2, 3))  # per row
    assert float(diff[0]) < 1e-12  # no leading padding: unchanged
    assert bool((diff[1:] > 1e-3).all()), diff


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [None, 4])
def test_padding_that_is_not_a_leading_block_behaves_as_before(causal, block):
    """Holes (a padded global token included) and right padding: the absolute positions."""
    est = _est(2, 2, block)
    q, k, v = _rand(3, 2, N, 4, seed=11), _rand(3, 2, N, 4, seed=12), _rand(3, 2, N, 3, seed=13)
    mask = torch.zeros(3, N, dtype=torch.bool)
    mask[0, 9:] = True  # right padding
    mask[1, 1] = True  # a hole at a global token
    mask[2, 4:6] = True  # a hole in the middle
    with torch.no_grad():
        out = est(q, k, v, causal=causal, key_padding_mask=mask)
        ref = _reference(est, q, k, v, causal, mask, None)
    torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("block", [None, 4])
@pytest.mark.parametrize(("n", "m"), [(5, 13), (17, 9)])
def test_cross_attention_offsets_the_keys(block, n, m):
    """N != M (non-causal): the global keys are the first g keys after the leading padding of
    the keys; the window stays where it is (queries and keys are two sequences)."""
    from kernelattn_hybrid.naive import leading_padding

    est = _est(2, 2, block)
    q, k, v = _rand(4, 2, n, 4, seed=14), _rand(4, 2, m, 4, seed=15), _rand(4, 2, m, 3, seed=16)
    mask = _left_mask(m)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = est(*xs, key_padding_mask=mask)
    ref = _reference(est, *xs, False, mask, leading_padding(mask))
    torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out.sum(), xs), torch.autograd.grad(ref.sum(), xs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_rows_follow_the_offsets(causal):
    est = _est(2, 2, None, num_heads=2)
    q, k = _rand(4, 2, N, 4, seed=17), _rand(4, 2, N, 4, seed=18)
    mask = _left_mask(N)
    rows = torch.tensor([0, 3, 5, 12])
    got = est.attention_rows(q, k, rows, causal=causal, key_padding_mask=mask)
    eye = torch.eye(N, dtype=F64).expand(4, 2, N, N)
    ref = est(q, k, eye, causal=causal, key_padding_mask=mask)[:, :, rows]
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------- decoding
def _decode(est, q, k, v, mask, first: int):  # type: ignore[no-untyped-def]
    """``first`` positions in one call, then one at a time (the mask sliced alongside)."""
    bounds = [(0, first), *((t, t + 1) for t in range(first, q.shape[2]))]
    outs, state = [], None
    for a, b in bounds:
        one = None if mask is None else mask[:, a:b]
        out, state = est.step(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], state, key_padding_mask=one)
        outs.append(out)
    return torch.cat(outs, dim=2), state


@pytest.mark.parametrize(
    ("window", "glob", "first"),
    [(w, g, f) for (w, g), f in itertools.product([(0, 1), (2, 1), (3, 2), (1, 3)], [1, 2, 6])],
)
def test_step_equals_the_forward_for_left_padded_rows(window, glob, first):
    """The sink slots hold the first g keys after each row's leading padding, also when the
    leading padding runs past the first call (first = 1, 2)."""
    est = _est(window, glob, None).eval()
    q, k, v = _rand(4, 2, N, 4, seed=19, scale=1.5), _rand(4, 2, N, 4, seed=20, scale=1.5), _rand(4, 2, N, 3, seed=21)
    mask = _left_mask(N)
    mask[0, 8] = True  # and a hole, in the row without leading padding
    full = est(q, k, v, causal=True, key_padding_mask=mask)
    got, state = _decode(est, q, k, v, mask, first)
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-12)
    root = est._input_root(4)
    for b, lead in enumerate(LEADS):
        torch.testing.assert_close(state.sink_keys[b], k[b, :, lead : lead + glob] * root, rtol=0, atol=0)
        assert bool(state.sink_valid[b].all())


@pytest.mark.parametrize(("window", "glob"), [(2, 1), (3, 2), (4, 1)])
@torch.no_grad()
def test_greedy_like_decoding_of_a_left_padded_batch_equals_each_prompt_alone(window, glob):
    """A left-padded prefill then token-by-token steps without a mask (the finite short step
    of the estimator included, as generate() runs it) give each prompt's rows alone."""
    est = _est(window, glob, None).eval()
    p, t = 9, 12  # prompt slots, new tokens
    q, k, v = _rand(4, 2, p + t, 4, seed=22), _rand(4, 2, p + t, 4, seed=23), _rand(4, 2, p + t, 3, seed=24)
    mask = _left_mask(p)
    out, state = est.step(q[:, :, :p], k[:, :, :p], v[:, :, :p], key_padding_mask=mask)
    outs = [out]
    for i in range(p, p + t):
        out, state = est.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], state)
        outs.append(out)
    batched = torch.cat(outs, 2)
    for b, lead in enumerate(LEADS):
        alone, st = est.step(q[b : b + 1, :, lead:p], k[b : b + 1, :, lead:p], v[b : b + 1, :, lead:p])
        rest = [alone]
        for i in range(p, p + t):
            one = slice(i, i + 1)
            out, st = est.step(q[b : b + 1, :, one], k[b : b + 1, :, one], v[b : b + 1, :, one], st)
            rest.append(out)
        torch.testing.assert_close(batched[b : b + 1, :, lead:], torch.cat(rest, 2), rtol=1e-10, atol=1e-12)


def test_step_state_of_a_row_that_is_all_padding_so_far_keeps_counting():
    est = _est(2, 2, None).eval()
    x = _rand(2, 1, 6, 4, seed=25)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, :4] = True
    _, state = est.step(x[:, :, :3], x[:, :, :3], x[:, :, :3], key_padding_mask=mask[:, :3])
    assert state.lead.tolist() == [0, 3] and not bool(state.sink_valid[1].any())
    _, state = est.step(x[:, :, 3:5], x[:, :, 3:5], x[:, :, 3:5], state, key_padding_mask=mask[:, 3:5])
    assert state.lead.tolist() == [0, 4] and state.sink_valid[1, 0].tolist() == [True, False]


def test_compiled_offsets_trace_as_one_graph_and_equal_eager():
    """Under torch.compile the offsets are always passed (no value read back: zeros for the
    rows without leading padding); one graph, the eager rows."""
    import torch._dynamo as dynamo

    torch.manual_seed(0)
    attn = ka.KernelAttention(16, 2, "sliding-window", batch_first=True, window=3, num_features=8, global_tokens=2)
    attn = attn.eval()
    x = torch.randn(3, 20, 16)
    pad = torch.zeros(3, 20, dtype=torch.bool)
    pad[1, :3] = True  # left padding
    pad[2, 17:] = True  # right padding

    def run(x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return attn(x, key_padding_mask=pad)[0]

    with torch.no_grad():
        report = dynamo.explain(run)(x, pad)
        assert report.graph_break_count == 0 and report.graph_count == 1
        dynamo.reset()
        got = torch.compile(run, fullgraph=True, backend="aot_eager")(x, pad)
        dynamo.reset()
        ref = run(x, pad)
    keep = ~pad[:, :, None]
    torch.testing.assert_close(got * keep, ref * keep, rtol=1e-5, atol=1e-6)
