"""The grouped engine (``engine/grouped.py``): features and attention per group of
positions, with its own backward. Checked against the one-shot torch path and the
quadratic reference on outputs *and* gradients (inputs and map parameters), by
``gradcheck`` in float64, and for what it must never do: form a whole-sequence feature
tensor, let a masked, future or non-finite value reach another row's output or gradient."""

from __future__ import annotations

import pytest
import torch

import kernelattn_core as ka
import kernelattn_core.engine.chunked as chunked
from kernelattn_core.engine import grouped as grp
from kernelattn_core.engine.grouped import group_length, grouped_feature_attention
from kernelattn_core.engine.naive import feature_attention_naive
from kernelattn_core.engine.torch_backend import feature_attention_step, feature_attention_torch

F64 = torch.float64
NAMES = ("prf", "elu", "rfa", "hcexp", "schoenbat", "trig-softmax", "rmf", "gmm-prf")


def _est(name: str, d: int = 8) -> ka.AttentionEstimator:
    est = ka.create(name) if name == "elu" else ka.create(name, num_features=16, head_dim=d, seed=0)
    return est.double().eval()


def _qkv(n: int, seed: int = 0, d: int = 8, dv: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 3, n, d, generator=g, dtype=F64) for _ in range(2))
    return q, k, torch.randn(2, 3, n, dv, generator=g, dtype=F64)


def _mask(n: int) -> torch.Tensor:
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[0, :5] = True  # the first rows of batch 0 see no key at all (causal)
    mask[1, n // 2 :] = True  # batch 1: the second half padded
    return mask


def _inputs(est: ka.AttentionEstimator, q: torch.Tensor, k: torch.Tensor, mask, causal):  # type: ignore[no-untyped-def]
    """Scaled and pre-transformed q, k as the map sees them, the map prepared."""
    s = est.scale or q.shape[-1] ** -0.5
    qs, ks = q * s**0.5, k * s**0.5
    if hasattr(est, "_pre"):
        qs, ks = est._pre(qs, ks, mask, causal)
    est.feature_map.prepare(qs.detach(), ks.detach(), key_padding_mask=mask, causal=causal)
    return qs.detach(), ks.detach()


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """Row normalisation, invariant to the engines' per-row stabilisers."""
    return num / torch.where(den == 0, torch.ones_like(den), den).unsqueeze(-1)


def _run(fn, fm, q, k, v, weight):  # type: ignore[no-untyped-def]
    """Output and the gradients of q, k, v and the map's trainable parameters."""
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    params = [p for p in fm.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    out = fn(*leaves)
    (out * weight).sum().backward()
    return [out, *(t.grad for t in leaves), *(p.grad.clone() for p in params)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_outputs_and_gradients_equal_the_one_shot_path(name: str, causal: bool) -> None:
    est = _est(name)
    if causal and not est.supports_causal:
        pytest.skip("non-causal estimator")
    q, k, v = _qkv(150)
    mask = _mask(150)
    k[1, :, 120] = 3.0  # padded: must not matter (non-finite padding: its own test below)
    v[1, :, 130] = -1e4
    qs, ks = _inputs(est, q, k, mask, causal)
    fm = est.feature_map
    if name == "gmm-prf":  # learned spectral map: its parameters get gradients too
        assert any(p.requires_grad for p in fm.parameters())
    weight = torch.linspace(-1, 2, v.shape[-1], dtype=F64)
    log = fm.log_space

    def one_shot(a, b, c):  # type: ignore[no-untyped-def]
        pq, pk = fm.raw_features(a, query=True), fm.raw_features(b, query=False)
        num, den = feature_attention_torch(
            pq, pk, c, log_space=log, causal=causal, key_padding_mask=mask, chunk_size=16
        )
        return _ratio(num, den)

    ref = _run(one_shot, fm, qs, ks, v, weight)
    for group in (32, 64, 160):  # several groups and a ragged last one, one group
        got = _run(
            lambda a, b, c, group=group: _ratio(
                *grouped_feature_attention(
                    fm, a, b, c, causal=causal, key_padding_mask=mask, chunk_size=16, group=group
                )
            ),
            fm,
            qs,
            ks,
            v,
            weight,
        )
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("log_space", [False, True])
def test_gradients_equal_autograd_through_the_quadratic_reference(log_space: bool, causal: bool) -> None:
    est = _est("prf" if log_space else "elu")
    fm = est.feature_map
    q, k, v = _qkv(40, seed=3)
    mask = _mask(40)
    weight = torch.linspace(-1, 2, v.shape[-1], dtype=F64)

    def naive(a, b, c):  # type: ignore[no-untyped-def]
        pq, pk = fm.raw_features(a, query=True), fm.raw_features(b, query=False)
        return _ratio(*feature_attention_naive(pq, pk, c, log_space=log_space, causal=causal, key_padding_mask=mask))

    def fast(a, b, c):  # type: ignore[no-untyped-def]
        return _ratio(
            *grouped_feature_attention(fm, a, b, c, causal=causal, key_padding_mask=mask, chunk_size=4, group=12)
        )

    for g, r in zip(_run(fast, fm, q, k, v, weight), _run(naive, fm, q, k, v, weight)):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["prf", "elu", "gmm-prf"])
def test_gradcheck_float64_with_padding_and_all_masked_rows(name: str, causal: bool) -> None:
    est = _est(name, d=4)
    fm = est.feature_map
    q, k, v = (t[:, :2] for t in _qkv(14, seed=4, d=4, dv=3))
    mask = _mask(14)  # batch 0: rows 0-4 see no key (causal); batch 1: half padded
    params = [p for p in fm.parameters() if p.requires_grad]

    def f(a, b, c, *ps):  # type: ignore[no-untyped-def]
        num, den = grouped_feature_attention(fm, a, b, c, causal=causal, key_padding_mask=mask, chunk_size=3, group=6)
        return _ratio(num, den)

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    assert torch.autograd.gradcheck(f, (*leaves, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_scale_and_normaliser_inside_the_groups(causal: bool) -> None:
    """``scale`` and ``normalize`` applied group by group equal scaling the inputs and
    normalising ``num`` and ``den`` afterwards, on outputs and gradients."""
    est = _est("prf")
    fm, norm = est.feature_map, est.normalizer
    q, k, v = _qkv(100, seed=5)
    mask = _mask(100)
    weight = torch.linspace(-1, 2, v.shape[-1], dtype=F64)

    def after(a, b, c):  # type: ignore[no-untyped-def]
        num, den = grouped_feature_attention(fm, a * 0.7, b * 0.7, c, causal=causal, key_padding_mask=mask, group=32)
        return norm.normalize(num, den)

    def inside(a, b, c):  # type: ignore[no-untyped-def]
        (out,) = grouped_feature_attention(
            fm, a, b, c, causal=causal, key_padding_mask=mask, group=32, scale=0.7, normalizer=norm
        )
        return out

    for g, r in zip(_run(inside, fm, q, k, v, weight), _run(after, fm, q, k, v, weight)):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_no_grad_and_autograd_calls_agree(causal: bool) -> None:
    est = _est("prf")
    q, k, v = _qkv(90, seed=6)
    with_grad = est(q.requires_grad_(True), k, v, causal=causal)
    with torch.no_grad():
        without = est(q, k, v, causal=causal)
    assert with_grad.requires_grad and not without.requires_grad
    assert torch.equal(with_grad.detach(), without)


def test_estimators_run_through_the_grouped_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every torch-backend call, with or without autograd, goes through the grouped
    engine, with the estimator's sqrt(scale) passed in rather than applied to the whole
    inputs; a map with its own ``prepare`` gets the scaled inputs instead."""
    calls = []
    real = grp.grouped_feature_attention

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs.get("scale"))
        return real(*args, **kwargs)

    monkeypatch.setattr(grp, "grouped_feature_attention", spy)
    q, k, v = _qkv(20, seed=7)
    prf = _est("prf")
    prf(q, k, v, causal=True)
    with torch.no_grad():
        prf(q, k, v)
    assert calls == [pytest.approx(8**-0.25)] * 2
    _est("hcexp")(q, k, v)  # CEXP adapts its statistics in prepare: scaled inputs, scale 1
    assert calls[-1] == 1.0


def test_a_huge_later_key_changes_neither_earlier_outputs_nor_their_gradients() -> None:
    fm = _est("prf").feature_map
    q, k, v = (t.float() for t in _qkv(64, seed=8))
    results = []
    for huge in (False, True):
        kk = k.clone()
        if huge:
            kk[:, :, 40] = 60.0 * q[:, :, 40] / q[:, :, 40].norm(dim=-1, keepdim=True)  # e^huge without the stabiliser
        a, b, c = (t.clone().requires_grad_(True) for t in (q, kk, v))
        num, den = grouped_feature_attention(
            fm.float(), a, b, c, causal=True, key_padding_mask=None, chunk_size=8, group=16
        )
        out = _ratio(num, den)
        assert torch.isfinite(out).all()
        out[:, :, :40].sum().backward()  # a loss on the rows before the huge key
        results.append((out[:, :, :40], a.grad[:, :, :40], b.grad[:, :, :40], c.grad[:, :, :40]))
    for before, after in zip(*results):
        assert torch.equal(before, after)


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_a_non_finite_value_reaches_only_the_rows_that_see_it_outputs_and_gradients(where: str) -> None:
    """A NaN at position 70 (group 3 of 5): earlier rows keep bit-identical outputs and
    gradients; the rows that see it are NaN (a NaN query: its own row only)."""
    fm = _est("prf").feature_map
    q, k, v = _qkv(100, seed=9)
    results = []
    for bad in (False, True):
        a, b, c = (t.clone() for t in (q, k, v))
        if bad:
            {"q": a, "k": b, "v": c}[where][0, 1, 70] = float("nan")
        a, b, c = (t.requires_grad_(True) for t in (a, b, c))
        num, den = grouped_feature_attention(fm, a, b, c, causal=True, key_padding_mask=None, chunk_size=8, group=24)
        out = _ratio(num, den)
        out[:, :, :70].sum().backward()
        results.append((out, a.grad, b.grad, c.grad))
    out = results[1][0]
    sees = torch.zeros(2, 3, 100, dtype=torch.bool)
    if where == "q":
        sees[0, 1, 70] = True
    else:
        sees[0, 1, 70:] = True
    assert torch.equal(torch.isnan(out).any(-1), sees)
    for before, after in zip(results[0], results[1]):
        assert torch.equal(before[:, :, :70], after[:, :, :70])  # outputs and gradients


@pytest.mark.parametrize("name", ["prf", "elu", "gmm-prf"])
def test_a_padded_non_finite_key_never_reaches_outputs_or_gradients(name: str) -> None:
    """Padded keys are zeroed before the map: their own gradient is exactly 0 (the
    one-shot path, fed features, gives the map's 0 * NaN there, and a learned map's
    parameter gradients NaN), and no other output or gradient sees them."""
    fm = _est(name).feature_map
    q, k, v = _qkv(60, seed=10)
    mask = torch.zeros(2, 60, dtype=torch.bool)
    mask[:, 33] = True
    k[:, :, 33] = float("nan")
    v[:, :, 33] = float("inf")
    params = [p for p in fm.parameters() if p.requires_grad]
    for causal in (False, True):
        for p in params:
            p.grad = None
        a, b, c = (t.clone().requires_grad_(True) for t in (q, k, v))
        num, den = grouped_feature_attention(fm, a, b, c, causal=causal, key_padding_mask=mask, group=16)
        _ratio(num, den).sum().backward()
        for t in (num, den, a.grad, b.grad, c.grad, *(p.grad for p in params)):
            assert torch.isfinite(t).all()
        assert (b.grad[:, :, 33] == 0).all() and (c.grad[:, :, 33] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_no_whole_sequence_feature_tensor_is_kept_for_the_backward(causal: bool) -> None:
    """What autograd keeps is the inputs, num and den and the group states: nothing of
    size N x D (the one-shot path keeps several such tensors)."""
    fm = ka.create("prf", num_features=64, head_dim=8, seed=0).feature_map
    q, k, v = (t.float().requires_grad_(True) for t in _qkv(512, seed=11))
    n, big = 512, 2 * 3 * 512 * 64  # B * H * N * D

    def saved_numels(fn) -> list[int]:  # type: ignore[no-untyped-def]
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sizes

    grouped = saved_numels(
        lambda: grouped_feature_attention(fm, q, k, v, causal=causal, key_padding_mask=None, group=128)
    )
    one_shot = saved_numels(
        lambda: feature_attention_torch(
            fm.raw_features(q, query=True),
            fm.raw_features(k, query=False),
            v,
            log_space=True,
            causal=causal,
            key_padding_mask=None,
        )
    )
    assert max(one_shot) >= big  # the control: the one-shot path keeps feature tensors
    assert max(grouped) < big
    assert sum(grouped) <= 6 * 2 * 3 * n * 8 + 4 * 64 * 9 * 2 * 3  # q, k, v, num, den + states


@pytest.mark.parametrize("name", ["prf", "elu", "gmm-prf"])
def test_second_derivatives_by_gradgradcheck(name: str) -> None:
    """Non-causal, ``create_graph=True`` takes a differentiable backward (the one-shot path
    recomputed under autograd): second derivatives of q, k, v and the map's parameters,
    with padding, checked by gradgradcheck in float64."""
    causal = False
    est = _est(name, d=4)
    fm, norm = est.feature_map, est.normalizer
    q, k, v = (t[:, :2] for t in _qkv(10, seed=12, d=4, dv=3))
    mask = _mask(10)
    params = [p for p in fm.parameters() if p.requires_grad]

    def f(a, b, c, *ps):  # type: ignore[no-untyped-def]
        (out,) = grouped_feature_attention(
            fm, a, b, c, causal=causal, key_padding_mask=mask, chunk_size=3, group=4, scale=0.8, normalizer=norm
        )
        return out

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    assert torch.autograd.gradgradcheck(f, (*leaves, *params), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_a_gradient_penalty_trains_through_the_engine() -> None:
    """Non-causal: the first-order gradients with ``create_graph=True`` equal the grouped
    backward's, and a penalty on them back-propagates. Causal: refused with a clear error."""
    fm = _est("prf").feature_map
    q, k, v = _qkv(40, seed=19)
    grads = []
    for create_graph in (False, True):
        a = q.clone().requires_grad_(True)
        num, den = grouped_feature_attention(fm, a, k, v, causal=False, key_padding_mask=None, group=16)
        (g,) = torch.autograd.grad(_ratio(num, den).pow(2).sum(), a, create_graph=create_graph)
        grads.append(g)
        if create_graph:
            g.pow(2).sum().backward()
            assert a.grad is not None and torch.isfinite(a.grad).all() and a.grad.abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)
    a = q.clone().requires_grad_(True)
    num, den = grouped_feature_attention(fm, a, k, v, causal=True, key_padding_mask=None, group=16)
    with pytest.raises(ka.InputError, match="create_graph"):
        torch.autograd.grad(_ratio(num, den).sum(), a, create_graph=True)


def test_the_gate_of_moving_chunks_only_is_bit_identical_to_gating_every_chunk() -> None:
    g = torch.Generator().manual_seed(13)
    m = torch.rand(2, 3, 6, 8, generator=g).cumsum(-1)  # [B, H, n_c, C], increasing
    m[0, 0, 2] = m[0, 0, 2, :1]  # some chunks constant (the common case after the start)
    m[1, 2, 4] = m[1, 2, 4, :1]
    tri = torch.ones(8, 8, dtype=torch.bool).tril()
    x = torch.randn(2, 3, 6, 8, 8, generator=g)
    full = x * chunked._gate(m.flatten(0, -2), tri).view_as(x)
    gate = chunked._Gate(m, tri)
    assert gate.idx.numel() == 2 * 3 * 6 - 2
    assert torch.equal(gate.apply_(x.clone(), tri), full)
    m2 = m[..., :1].expand_as(m).contiguous()  # every chunk constant: the causal mask alone
    assert chunked._Gate(m2, tri).gate is None
    assert torch.equal(chunked._Gate(m2, tri).apply_(x.clone(), tri), x * tri)


def test_decoding_state_carries_a_consumed_non_finite_key() -> None:
    """A NaN key consumed by an earlier call poisons every later row, as in the one-call
    form (the state itself stays finite)."""
    g = torch.Generator().manual_seed(3)
    pq, pk = (torch.randn(1, 2, 10, 4, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(1, 2, 10, 3, generator=g, dtype=F64)
    pk[0, 0, 2] = float("nan")
    whole, _, _ = feature_attention_step(pq, pk, v, log_space=True, key_padding_mask=None, state=None)
    _, _, state = feature_attention_step(
        pq[:, :, :5], pk[:, :, :5], v[:, :, :5], log_space=True, key_padding_mask=None, state=None
    )
    assert state.poisoned is not None and state.poisoned.tolist() == [[True, False]]
    assert torch.isfinite(state.kv).all()
    later, _, _ = feature_attention_step(
        pq[:, :, 5:], pk[:, :, 5:], v[:, :, 5:], log_space=True, key_padding_mask=None, state=state
    )
    assert torch.isnan(later[0, 0]).all() and torch.isfinite(later[0, 1]).all()
    torch.testing.assert_close(later, whole[:, :, 5:], equal_nan=True)


def test_group_length_bounds_the_block_and_is_a_chunk_multiple() -> None:
    g = group_length(4, 128, 4, 64)
    assert g % 64 == 0 and 4 * 128 * 4 * g <= grp.GROUP_BYTES < 4 * 128 * 4 * (g + 64)
    assert group_length(10**6, 128, 8, 64) == 64  # at least one chunk


@pytest.mark.parametrize("causal", [True, False])
def test_a_short_training_call_is_one_group_whatever_the_byte_bound(monkeypatch, causal: bool) -> None:
    """A training call of at most SHORT_TRAINING positions runs as one group even where the
    byte bound would cut it (here into groups of 8), with the several groups' outputs and
    gradients; an inference call of the same inputs keeps the byte bound, and so does a
    training call with SHORT_TRAINING = 0."""
    monkeypatch.setattr(grp, "GROUP_BYTES", 2 * 3 * 16 * 8 * 8)  # [2, 3, 8, 16] float64: 8 positions
    spans: list[int] = []
    real = grp._Call.spans
    monkeypatch.setattr(grp._Call, "spans", lambda self, n: spans.append(len(real(self, n))) or real(self, n))
    est = _est("prf")
    fm = est.feature_map
    q, k, v = (t.requires_grad_() for t in _qkv(40))

    def run(short: int) -> tuple[torch.Tensor, ...]:
        monkeypatch.setattr(grp, "SHORT_TRAINING", short)
        spans.clear()
        num, den = grouped_feature_attention(fm, q, k, v, causal=causal, key_padding_mask=None, chunk_size=8)
        out = num / den.unsqueeze(-1)
        return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))

    one = run(128)
    assert max(spans) == 1
    several = run(0)
    assert max(spans) == 5  # 40 positions in groups of 8
    for a, b in zip(one, several):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    monkeypatch.setattr(grp, "SHORT_TRAINING", 128)
    spans.clear()
    with torch.no_grad():
        grouped_feature_attention(fm, q, k, v, causal=causal, key_padding_mask=None, chunk_size=8)
    assert max(spans) == 5  # inference: the byte bound
    spans.clear()
    grouped_feature_attention(fm, q, k, v, causal=causal, key_padding_mask=None, chunk_size=8, group=16)
    assert max(spans) == 3  # an explicit group is kept


def _peak_fwd_bwd(fn, n: int) -> int:  # type: ignore[no-untyped-def]
    from kernelattn_core.cli.measure import peak_memory

    q, k, v = (t.float().requires_grad_(True) for t in _qkv(n, seed=14))
    return peak_memory(lambda: torch.autograd.grad(fn(q, k, v).sum(), (q, k, v)), q.device)


def _increments_ratio(fn) -> float:  # type: ignore[no-untyped-def]
    """(peak(4n) - peak(2n)) / (peak(2n) - peak(n)): 2 when memory is linear in N, 4 when
    quadratic."""
    p = [_peak_fwd_bwd(fn, n) for n in (256, 512, 1024)]
    return (p[2] - p[1]) / (p[1] - p[0])


@pytest.mark.parametrize("causal", [False, True])
def test_peak_memory_of_forward_and_backward_is_linear_in_n(causal: bool) -> None:
    """Peak tensor memory of a forward + backward, counted allocation by allocation (not
    timed): its increments double when N doubles; the quadratic reference (control)
    quadruples them."""
    fm = ka.create("prf", num_features=16, head_dim=8, seed=0).feature_map

    def grouped(a, b, c):  # type: ignore[no-untyped-def]
        return _ratio(*grouped_feature_attention(fm, a, b, c, causal=causal, key_padding_mask=None, group=64))

    def naive(a, b, c):  # type: ignore[no-untyped-def]
        pq, pk = fm.raw_features(a, query=True), fm.raw_features(b, query=False)
        return _ratio(*feature_attention_naive(pq, pk, c, log_space=True, causal=causal, key_padding_mask=None))

    assert 1.8 <= _increments_ratio(grouped) <= 2.4  # measured 2.0 (causal), 2.13
    assert _increments_ratio(naive) > 3.0


def test_a_redraw_or_a_changed_mask_between_forward_and_backward_leaves_the_gradients_alone() -> None:
    """The backward pass recomputes the features with the map's buffers and the mask as
    the forward pass saw them (a second training call may redraw, or a caller reuse the
    mask tensor): the gradients are those of the forward pass that was run."""
    est = ka.create("prf", num_features=16, head_dim=8, seed=0, redraw_every=1).double().train()
    q, k, v = _qkv(40, seed=15)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[1, 30:] = True
    grads = []
    for disturb in (False, True):
        a = q.clone().requires_grad_(True)
        torch.manual_seed(0)
        est.redraw_policy = type(est.redraw_policy)(1, 0)  # the same draws for both runs
        m = mask.clone()
        out = est(a, k, v, causal=True, key_padding_mask=m)
        if disturb:
            est(q, k, v, causal=True)  # a redraw of the features, in place
            m.zero_()  # and the caller reuses its mask tensor
        out.sum().backward()
        grads.append(a.grad)
    assert torch.equal(grads[0], grads[1])


class _ScaledRow(ka.Normalizer):
    """A normaliser with a trainable parameter inside ``normalize`` (test only)."""

    name = "test-scaled-row"
    learnable = True

    def __init__(self) -> None:
        super().__init__()
        self.t = torch.nn.Parameter(torch.tensor(0.5, dtype=F64))

    def normalize(self, num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        return super().normalize(num, den) * self.t


@pytest.mark.parametrize("causal", [False, True])
def test_a_normaliser_parameter_gets_its_gradient(causal: bool) -> None:
    """The normaliser runs per group inside the engine; its parameters are inputs of the
    engine's Function and get the gradient of the one-shot path."""
    norm = _ScaledRow()
    est = ka.FeatureMapAttention("prf", norm, num_features=16, head_dim=8, seed=0).double()
    fm = est.feature_map
    q, k, v = _qkv(50, seed=16)
    est(q, k, v, causal=causal).pow(2).sum().backward()  # q, k, v need no gradient: only t
    got = norm.t.grad.clone()
    norm.t.grad = None
    s = 8**-0.25
    num, den = feature_attention_torch(
        fm.raw_features(q * s, query=True),
        fm.raw_features(k * s, query=False),
        v,
        log_space=True,
        causal=causal,
        key_padding_mask=None,
    )
    norm.normalize(num, den).pow(2).sum().backward()
    torch.testing.assert_close(got, norm.t.grad, rtol=1e-10, atol=0)


class _KeyOnly(ka.FeatureMap):
    """Queries get constant features, so the output does not depend on ``q`` (test only)."""

    name = "test-key-only"
    random = False
    has_budget = False

    def _feature_dim(self) -> int:
        return self.head_dim  # type: ignore[return-value]

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        return torch.ones_like(x) if is_query else torch.nn.functional.elu(x) + 1.0


@pytest.mark.parametrize("causal", [False, True])
def test_an_input_the_output_does_not_depend_on_gets_a_zero_gradient(causal: bool) -> None:
    est = ka.FeatureMapAttention(_KeyOnly(head_dim=8)).double()
    q, k, v = (t.requires_grad_(True) for t in _qkv(300, seed=17))
    est(q, k, v, causal=causal).sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))  # not uninitialised memory
    assert k.grad.abs().sum() > 0


@pytest.mark.parametrize("causal", [False, True])
def test_autocast_does_not_change_the_engine_s_precision(causal: bool) -> None:
    """Under CPU bfloat16 autocast the engine still computes in float32 (the forward and
    the backward's recomputation alike): outputs and gradients equal the float32 call.
    Large key log-features make a bfloat16 recomputation visibly wrong."""
    est = ka.create("prf", num_features=16, head_dim=8, seed=0)
    q, k, v = (t.float() for t in _qkv(40, seed=18))
    k = 2 * k + 40.0
    results = []
    for autocast in (False, True):
        a, b, c = (t.clone().requires_grad_(True) for t in (q, k, v))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = est(a, b, c, causal=causal)
        (out.float() * torch.linspace(-1, 1, 8)).sum().backward()
        results.append((out.float(), a.grad, b.grad, c.grad))
    for plain, autocast in zip(*results):
        torch.testing.assert_close(autocast, plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", ["prf", "hedgehog"])
def test_a_single_group_holds_its_graph_and_equals_the_recomputing_backward(name: str, causal: bool) -> None:
    """A training call that fits one group keeps the features' local graph from the
    forward pass: its backward calls the map 0 times (several groups: once per group and
    side), its gradients (inputs and the map's parameters) equal the recomputing path's,
    and a second backward pass through a retained graph gives them again."""
    est = ka.create(name, num_features=16, head_dim=8, seed=0).double().train()
    fm = est.feature_map
    q, k, v = _qkv(128, seed=5)
    qs, ks = _inputs(est, q, k, _mask(128), causal)
    weight = torch.randn(2, 3, 128, 9, generator=torch.Generator().manual_seed(6), dtype=F64)
    calls = {"n": 0}
    raw = fm.raw_features

    def counted(x, *, query):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return raw(x, query=query)

    fm.raw_features = counted  # type: ignore[method-assign]

    def run(group: int) -> tuple[list[torch.Tensor], int]:
        leaves = [t.clone().requires_grad_(True) for t in (qs, ks, v)]
        for p in fm.parameters():
            p.grad = None
        num, den = grouped_feature_attention(
            fm, *leaves, causal=causal, key_padding_mask=_mask(128), group=group, chunk_size=32
        )
        loss = (torch.cat([num, den.unsqueeze(-1)], -1).nan_to_num() * weight).sum()
        before = calls["n"]
        loss.backward(retain_graph=True)
        backward_calls = calls["n"] - before
        first = [t.grad.clone() for t in leaves] + [p.grad.clone() for p in fm.parameters() if p.grad is not None]
        loss.backward()  # again through the retained graph: the gradients double
        for a, t in zip(first, leaves):
            torch.testing.assert_close(t.grad, 2 * a, rtol=1e-12, atol=1e-12)
        return first, backward_calls

    held, held_calls = run(group=128)
    recomputed, recomputed_calls = run(group=32)
    assert held_calls == 0
    assert recomputed_calls == 2 * 4  # q and k features of each of the 4 groups (query and key groups)
    assert len(held) == len(recomputed) == 3 + len([p for p in fm.parameters() if p.requires_grad])
    for a, b in zip(held, recomputed):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(("dv", "expected"), [(8, 32), (32, 32), (33, 64), (64, 64)])
def test_the_default_chunk_follows_the_value_width(dv: int, expected: int) -> None:
    """``chunk_size=None`` runs the chunk :func:`~kernelattn_core.engine.chunked.default_chunk`
    picks for the values' width (32 up to d_v = 32, 64 above): bit-identical to passing
    that chunk, and not to the other one (the chunk length changes the rounding)."""
    est = _est("prf", d=8)
    q, k, v = _qkv(192, seed=3, d=8, dv=dv)
    qs, ks = _inputs(est, q, k, None, True)
    fm = est.feature_map

    def call(chunk: int | None) -> torch.Tensor:
        num, den = grouped_feature_attention(
            fm, qs, ks, v, causal=True, key_padding_mask=None, chunk_size=chunk, scale=1.0
        )
        return _ratio(num, den)

    default, other = call(None), call(96 - expected)
    assert torch.equal(default, call(expected))
    assert not torch.equal(default, other)
    torch.testing.assert_close(default, other)  # the same attention, rounded otherwise
