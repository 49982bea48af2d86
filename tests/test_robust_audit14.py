"""Robustness audit 14: gradients of an all-padded sequence in the sampling estimators,
option values refused by name (non-finite noise, scales and epsilons, backends, learn
flags, kernel options), a feature map left whole after a refused build, the trig-softmax
range, the build budget of the spectral maps and the grouped engine's head-count message."""

from __future__ import annotations

import math

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.errors import DomainError, InputError

torch.set_num_threads(1)

SAMPLING = ("ra", "ra-biased", "lara", "rfa-snis")


def _qkv(b: int = 2, h: int = 2, n: int = 7, m: int = 9, d: int = 4, dv: int = 3, scale: float = 0.4):
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * scale).requires_grad_()
    k = (torch.randn(b, h, m, d, generator=g, dtype=torch.float64) * scale).requires_grad_()
    v = torch.randn(b, h, m, dv, generator=g, dtype=torch.float64).requires_grad_()
    return q, k, v


# --------------------------------------------------------------------------- 1. all-padded keys
@pytest.mark.parametrize("name", SAMPLING)
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("loss_on", ["all", "other"])
def test_sampling_all_padded_sequence_gives_zero_output_and_finite_gradients(
    name: str, training: bool, loss_on: str
) -> None:
    """A batch element whose keys are all padded: zero output rows and gradients that are
    finite everywhere and zero on that element, whether or not the loss reads it."""
    est = ka.create(name, num_features=16, seed=0).double().train(training)
    q, k, v = _qkv()
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0] = True
    out = est(q, k, v, key_padding_mask=mask)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all()
    (out if loss_on == "all" else out[1]).sum().backward()
    for arg, t in (("q", q), ("k", k), ("v", v)):
        assert torch.isfinite(t.grad).all(), (name, arg)
        assert (t.grad[0] == 0).all(), (name, arg)


@pytest.mark.parametrize("name", SAMPLING)
def test_sampling_all_padded_row_beside_partly_padded_rows_keeps_their_gradients(name: str) -> None:
    """Three sequences: all padded, partly padded (key 0 padded too), unpadded; the other
    sequences' outputs and gradients are those of the same call where the first sequence
    keeps some keys."""
    est = ka.create(name, num_features=16, seed=0).double().eval()
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[1, :4] = True
    grads = []
    for first in (slice(0, 9), slice(0, 5)):
        q, k, v = _qkv(b=3)
        mask[0] = False
        mask[0, first] = True
        out = est(q, k, v, key_padding_mask=mask)
        out[1:].sum().backward()
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()
        grads.append((out[1:], q.grad[1:], k.grad[1:], v.grad[1:]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_lara_module_cross_attention_all_padded_memory_keeps_parameter_gradients_finite() -> None:
    torch.manual_seed(0)
    m = ka.KernelAttention(8, 2, estimator="lara", num_features=8, seed=0, batch_first=True)
    x, mem = torch.randn(2, 5, 8), torch.randn(2, 7, 8)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[0] = True
    out, _ = m(x, mem, mem, key_padding_mask=kpm)
    out[1].sum().backward()
    bad = [n for n, p in m.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert bad == []


def test_safe_softmax_stats_all_minus_inf_row_has_zero_gradient() -> None:
    from kernelattn_sampling.functional import safe_softmax_stats

    inf = float("inf")
    logits = torch.tensor([[0.5, -1.0, 2.0], [-inf, -inf, -inf]], dtype=torch.float64, requires_grad=True)
    values = torch.randn(3, 2, dtype=torch.float64)
    log_den, mean = safe_softmax_stats(logits, values)
    assert log_den[1] == -inf and (mean[1] == 0).all()
    torch.testing.assert_close(log_den[0], torch.logsumexp(logits[0].detach(), -1))
    (log_den[0] + log_den[1].clamp_min(-1.0) + mean.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[1] == 0).all()


# --------------------------------------------------------------------------- 2. noise_std
@pytest.mark.parametrize("name", ["ra", "ra-biased", "lara"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), -0.5])
def test_sampling_non_finite_noise_std_is_refused_by_name(name: str, bad: float) -> None:
    with pytest.raises(InputError, match=r"noise_std: expected .*finite number >= 0.*got"):
        ka.create(name, num_features=8, seed=0, noise_std=bad)


@pytest.mark.parametrize("name", ["ra", "ra-biased", "lara"])
def test_sampling_finite_noise_std_still_accepted(name: str) -> None:
    for ok in (0, 0.0, 0.3, "paper", "code"):
        ka.create(name, num_features=8, seed=0, noise_std=ok)


# --------------------------------------------------------------------------- 3. refused build
@pytest.mark.parametrize("name", ["fastfood-prf", "fastfood-rks"])
def test_fastfood_refused_head_dim_leaves_the_map_unbuilt(name: str) -> None:
    est = ka.create(name, num_features=8, seed=0)
    fm = est.feature_map
    for _ in range(2):  # the same InputError every time
        with pytest.raises(InputError, match=r"head_dim: FastFood needs a power of two"):
            est(*(torch.randn(1, 2, 5, 3) for _ in range(3)))
        assert not fm.built and fm.head_dim is None
        assert int(fm._built_head_dim) == -1
        assert not hasattr(fm, "B")
    out = est(*(torch.randn(1, 2, 5, 4) for _ in range(3)))  # a later valid d builds
    assert torch.isfinite(out).all()
    assert fm.built and fm.head_dim == 4 and int(fm._built_head_dim) == 4
    # the state dict of the map built afterwards is that of a map built at once
    fresh = ka.create(name, num_features=8, seed=0, head_dim=4).feature_map
    assert sorted(fm.state_dict()) == sorted(fresh.state_dict())


def test_feature_map_whose_build_raises_is_rolled_back() -> None:
    """A test-local map whose ``_build`` registers a parameter, a buffer, a submodule and
    an attribute before refusing odd dimensions: each refusal is the same InputError, no
    partial state survives (a state dict without them, ``_built_head_dim`` -1) and an even
    dimension builds afterwards."""
    from torch import nn

    class HalfBuilt(ka.FeatureMap):
        name = "half-built-test"
        calls = 0

        def _build(self, head_dim: int) -> None:
            type(self).calls += 1
            self.w = nn.Parameter(torch.zeros(self.num_features, head_dim))
            self.register_buffer("b", torch.zeros(head_dim))
            self.lin = nn.Linear(head_dim, 2)
            self.flag = True
            if head_dim % 2:
                raise InputError(f"head_dim: expected an even number, got d = {head_dim}")

        def _feature_dim(self) -> int:
            return self.num_features

        def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
            return (x @ self.w.T).relu()

    fm = HalfBuilt(num_features=4)
    before = sorted(fm.state_dict())
    for _ in range(2):
        with pytest.raises(InputError, match=r"head_dim: expected an even number, got d = 3"):
            fm.build(3)
        assert not fm.built and fm.head_dim is None and int(fm._built_head_dim) == -1
        assert sorted(fm.state_dict()) == before
        assert not any(hasattr(fm, a) for a in ("w", "b", "lin", "flag"))
        assert list(fm.parameters()) == []
        with pytest.raises(InputError, match=r"head_dim: expected an even number"):
            fm.query(torch.randn(2, 3))
    assert HalfBuilt.calls == 4
    fm.build(4)
    assert fm.built and fm.head_dim == 4 and int(fm._built_head_dim) == 4
    assert fm.query(torch.randn(2, 4)).shape == (2, 4)
    with pytest.raises(InputError, match=r"was built for d = 4, got d = 3"):
        fm.build(3)


def test_feature_map_whose_redraw_raises_during_build_is_rolled_back() -> None:
    class BadDraw(ka.FeatureMap):
        name = "bad-draw-test"

        def _build(self, head_dim: int) -> None:
            self.register_buffer("omega", torch.zeros(self.num_features, head_dim))

        def _redraw(self, generator: torch.Generator | None) -> None:
            if self.omega.shape[1] == 3:
                raise InputError("head_dim: no draw for d = 3")
            self.omega.normal_(generator=generator)

        def _feature_dim(self) -> int:
            return self.num_features

        def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
            return (x @ self.omega.T).exp()

    fm = BadDraw(num_features=4)
    with pytest.raises(InputError, match="no draw for d = 3"):
        fm.build(3)
    assert not fm.built and not hasattr(fm, "omega") and int(fm._built_head_dim) == -1
    fm.build(5)
    assert fm.omega.shape == (4, 5)


# --------------------------------------------------------------------------- 4. trig range
TRIG = ("trig-softmax", "trig-softmax-features")


def _trig_inputs(norm: float, dtype: torch.dtype, n: int = 9):
    from kernelattn_core.testing.fuzz import _tensors

    return _tensors(0, 1, 2, n, n, 4, 3, norm, dtype)


@pytest.mark.parametrize("name", TRIG)
@pytest.mark.parametrize(("dtype", "norm"), [(torch.float32, 14.0), (torch.float32, 20.0), (torch.float64, 40.0)])
def test_trig_softmax_keys_past_the_overflow_bound_raise_domain_error(
    name: str, dtype: torch.dtype, norm: float
) -> None:
    est = ka.create(name, num_features=16, seed=0).eval()
    q, k, v = _trig_inputs(norm, dtype)
    bound = math.sqrt(2 * math.log(torch.finfo(dtype).max))
    with pytest.raises(DomainError, match=rf"k: .*\|\|k\|\| <= {bound:.4g}.*got max \|\|k\|\| = {norm:.4g}"):
        est(q, k, v)
    small = k.clone()
    small[:, :, 1:] *= 0.5 / norm  # one key past the bound is enough
    with pytest.raises(DomainError, match=r"k: "):
        est(q, small, v)


@pytest.mark.parametrize("name", TRIG)
def test_trig_softmax_causal_keeps_the_prefix_before_an_overflowing_key(name: str) -> None:
    """Causal: not refused (a later position must not make a prefix fail, EN002); the rows
    before the first overflowing key are those of the prefix, the rows from it on NaN."""
    est = ka.create(name, num_features=16, seed=0).eval()
    q, k, v = _trig_inputs(1.0, torch.float32)
    k = k.clone()
    k[:, :, 6:] *= 20.0
    out = est(q, k, v, causal=True)
    assert out[:, :, 6:].isnan().all() and torch.isfinite(out[:, :, :6]).all()
    torch.testing.assert_close(out[:, :, :6], est(q[:, :, :6], k[:, :, :6], v[:, :, :6], causal=True))
    step, _ = est.step(q[:, :, 5:8], k[:, :, 5:8], v[:, :, 5:8])
    assert torch.isfinite(step[:, :, 0]).all()


@pytest.mark.parametrize("name", TRIG)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_trig_softmax_keys_inside_the_bound_stay_finite(name: str, dtype: torch.dtype) -> None:
    est = ka.create(name, num_features=16, seed=0).eval()
    for norm in (0.5, 10.0, 13.0):
        q, k, v = _trig_inputs(norm, dtype)
        for causal in (False, True):
            assert torch.isfinite(est(q, k, v, causal=causal)).all(), (norm, causal)


@pytest.mark.parametrize("name", TRIG)
def test_trig_softmax_padded_or_non_finite_large_keys_are_not_refused(name: str) -> None:
    """Padded keys past the bound are never seen (finite output and gradients, in forward
    and in a masked step); a NaN key is quarantined as before (its rows NaN), not refused."""
    est = ka.create(name, num_features=16, seed=0).eval()
    q, k, v = _trig_inputs(1.0, torch.float32)
    k = k.clone()
    k[:, :, 6:] *= 100.0
    mask = torch.zeros(1, 9, dtype=torch.bool)
    mask[:, 6:] = True
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for causal in (False, True):
        out = est(q, k, v, causal=causal, key_padding_mask=mask)
        assert torch.isfinite(out).all()
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(bool(torch.isfinite(g).all()) for g in grads)
    out, _ = est.step(q[:, :, 5:8], k[:, :, 5:8], v[:, :, 5:8], key_padding_mask=mask[:, 5:8])
    assert torch.isfinite(out).all()
    bad = k.detach().clone()
    bad[:, :, 6:] = float("nan")
    out = est(q.detach(), bad, v.detach())
    assert out.isnan().all()  # every row sees the NaN keys, as before


def test_trig_softmax_empty_query_side_is_not_refused() -> None:
    est = ka.create("trig-softmax", num_features=16, seed=0).eval()
    q, k, v = _trig_inputs(20.0, torch.float32)
    assert est(q[:, :, :0], k, v).shape == (1, 2, 0, 3)


# --------------------------------------------------------------------------- 5. build budgets
@pytest.mark.parametrize(
    ("name", "options", "arg"),
    [
        # each case's first large tensor is far beyond memory, except gmm-rks at d = 9000
        # (4 x 9000 x 9000 factors, 1.3 GB in float32: allowed before, over the draw budget)
        ("gmm-rks", {"head_dim": 200_000}, "head_dim"),
        ("gmm-rks", {"head_dim": 9_000, "components": 4, "num_features": 8}, "head_dim"),
        ("generative-rks", {"head_dim": 200_000}, "head_dim"),
        ("generative-prf", {"head_dim": 200_000}, "head_dim"),
        ("generative-rks", {"head_dim": 100_000}, "head_dim"),
        ("generative-prf", {"head_dim": 4, "hidden_dims": [8, 10**11]}, "hidden_dims"),
        ("generative-prf", {"head_dim": 4, "hidden_dims": [10**6, 10**6]}, "hidden_dims"),
        ("generative-rks", {"head_dim": 4, "noise_dim": 2**34}, "noise_dim"),
    ],
)
def test_spectral_builds_past_the_budget_are_refused_before_allocating(name: str, options: dict, arg: str) -> None:
    opts = {"num_features": 8, **options}
    with pytest.raises(InputError, match=rf"^{arg}: expected .*2 GiB.*got {arg} = "):
        ka.create(name, **opts)
    # a lazy build refused the same way leaves the map unbuilt; a small head dimension builds
    lazy = {key: val for key, val in opts.items() if key != "head_dim"}
    est = ka.create(name, **lazy)
    with pytest.raises(InputError, match=rf"^{arg}: expected .*2 GiB"):
        est.feature_map.build(opts["head_dim"])
    assert not est.feature_map.built
    if arg == "head_dim":
        assert torch.isfinite(est(*(torch.randn(1, 2, 3, 4) for _ in range(3)))).all()


@pytest.mark.parametrize("name", ["gmm-rks", "gmm-prf", "generative-rks", "generative-prf"])
def test_spectral_builds_inside_the_budget_still_build(name: str) -> None:
    est = ka.create(name, num_features=8, head_dim=64)
    assert est.feature_map.built


# --------------------------------------------------------------------------- 6. option errors
@pytest.mark.parametrize("bad", [[], {}, 3, ("torch",), b"torch"])
def test_backend_that_is_not_a_name_is_refused_by_name(bad: object) -> None:
    q = k = v = torch.randn(1, 2, 4, 4)
    est = ka.create("prf", num_features=8, seed=0, backend=bad)
    with pytest.raises(InputError, match=r"^backend: expected one of \[.*'torch'.*\], got "):
        est(q, k, v)
    with pytest.raises(InputError, match=r"^backend: expected one of "):
        est.step(q, k, v)


def test_backend_unknown_name_still_lists_the_backends() -> None:
    q = k = v = torch.randn(1, 2, 4, 4)
    with pytest.raises(InputError, match=r"^backend: expected one of \[.*\], got 'nope'"):
        ka.create("prf", num_features=8, seed=0, backend="nope")(q, k, v)


@pytest.mark.parametrize("name", ["fastfood-prf", "fastfood-rks"])
@pytest.mark.parametrize("bad", [[], {}, None, 1])
def test_fastfood_learn_of_the_wrong_type_is_refused_by_name(name: str, bad: object) -> None:
    with pytest.raises(InputError, match=r"^learn: expected one of \[.*'sgb'.*\], got "):
        ka.create(name, num_features=8, learn=bad)


@pytest.mark.parametrize("name", ["rmfa", "rmf"])
def test_maclaurin_unknown_kernel_options_are_refused_listing_the_accepted_ones(name: str) -> None:
    with pytest.raises(InputError, match=r"^kernel_options: kernel 'exp' takes no options, got \['x'\]"):
        ka.create(name, num_features=8, kernel_options={"x": 1})
    with pytest.raises(InputError, match=r"^kernel_options: kernel 'polynomial' takes .*'degree'.*, got \['deg'\]"):
        ka.create(name, num_features=8, kernel="polynomial", kernel_options={"deg": 3})
    ka.create(name, num_features=8, kernel="polynomial", kernel_options={"c": 1, "degree": 3})


@pytest.mark.parametrize(("name", "options"), [("rfa", {}), ("rfa-gate", {}), ("rfa-features", {})])
def test_num_heads_mismatch_names_the_callers_q_and_its_shape(name: str, options: dict) -> None:
    q = k = v = torch.randn(1, 2, 4, 4)
    for causal in (True,) if name == "rfa-gate" else (False, True):
        with pytest.raises(InputError, match=r"^q: .*num_heads = 3.*got shape \(1, 2, 4, 4\)"):
            ka.create(name, num_features=8, num_heads=3, **options)(q, k, v, causal=causal)


def test_num_heads_mismatch_hedgehog_names_the_callers_q_and_its_shape() -> None:
    pytest.importorskip("kernelattn_hybrid")
    q = k = v = torch.randn(1, 2, 4, 4)
    with pytest.raises(InputError, match=r"^q: hedgehog .*num_heads = 3.*got shape \(1, 2, 4, 4\)"):
        ka.create("hedgehog", num_features=8, num_heads=3)(q, k, v)


# --------------------------------------------------------------------------- 7. finite options, laplacian
@pytest.mark.parametrize("name", ["rfa", "rfa-gate", "rfa-features"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 0.0, -1.0, True])
def test_rfa_init_scale_must_be_a_finite_positive_number(name: str, bad: object) -> None:
    with pytest.raises(InputError, match=r"^init_scale: expected a finite number > 0, got "):
        ka.create(name, num_features=8, init_scale=bad)
    ka.create(name, num_features=8, init_scale=2.5)


@pytest.mark.parametrize(
    ("option", "bad"),
    [
        ("bn_eps", float("inf")),
        ("bn_eps", float("nan")),
        ("bn_eps", -1.0),
        ("bn_eps", True),
        ("row_scale", float("inf")),
    ],
)
def test_schoenbat_non_finite_epsilon_and_row_scale_are_refused(option: str, bad: object) -> None:
    with pytest.raises(InputError, match=rf"^{option}: expected a finite number"):
        ka.create("schoenbat", num_features=8, **{option: bad})
    ka.create("schoenbat", num_features=8, bn_eps=0.0)


def test_exact_laplacian_double_backward_and_gradients() -> None:
    est = ka.create("laplacian").double()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 4, 2, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: est(a, b, c), (q, k, v))
    assert torch.autograd.gradgradcheck(lambda a, b, c: est(a, b, c), (q, k, v))
    (gq,) = torch.autograd.grad(est(q, q, q).sum(), q, create_graph=True)
    (ggq,) = torch.autograd.grad(gq.sum(), q)
    assert torch.isfinite(ggq).all()


def test_laplacian_l1_distance_matches_cdist_with_broadcast_batches() -> None:
    from kernelattn_fourier.kernels import _L1Distance

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 1, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 4, 6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, 5, 6, generator=g, dtype=torch.float64)
    ours = _L1Distance.apply(q, k)
    ref = torch.cdist(q, k, p=1.0)
    torch.testing.assert_close(ours, ref)
    got = torch.autograd.grad((ours * w).sum(), (q, k))
    want = torch.autograd.grad((ref * w).sum(), (q, k))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    got2 = torch.autograd.grad((_L1Distance.apply(q, k) * w).sum(), (q, k), create_graph=True)
    for a, b in zip(got2, want):
        torch.testing.assert_close(a, b)
