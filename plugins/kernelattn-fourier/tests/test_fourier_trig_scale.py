"""The trig-softmax overflow check with the estimator's factor applied in the engine: the
map's ``prepare`` takes the factor (``prepare_takes_scale``), so feature-map attention
makes no scaled copies of ``q`` and ``k``, and the bound still refers to the scaled key
norm."""

from __future__ import annotations

import math

import pytest
import torch
from kernelattn_fourier.feature_maps import TrigSoftmaxFeatures

import kernelattn_core as ka
from kernelattn_core import FeatureMapAttention
from kernelattn_core.toolkit import DomainError

TRIG = ("trig-softmax", "trig-softmax-features")


def _bound(dtype: torch.dtype) -> float:
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return math.sqrt(2.0 * math.log(torch.finfo(compute).max))


def _inputs(scaled_norm: float, root: float, dtype: torch.dtype, d: int = 4, n: int = 9):
    """Small queries, keys and values; key 4 of every head has the scaled norm
    ``scaled_norm`` (unscaled norm ``scaled_norm / root``, along (1, .., 1))."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, n, d, generator=g, dtype=torch.float64) * 0.3
    k = torch.randn(1, 2, n, d, generator=g, dtype=torch.float64) * 0.3
    v = torch.randn(1, 2, n, 3, generator=g, dtype=torch.float64)
    k[:, :, 4] = scaled_norm / root / math.sqrt(d)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", TRIG)
def test_trig_softmax_attention_leaves_the_scale_to_the_engine(
    name: str, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The map's prepare takes the factor, so ``_attend_scaled`` hands ``root`` to the
    engine: ``_attend_features`` gets the caller's (unscaled) ``q`` and ``k`` and
    ``root = d^(-1/4)``, and ``prepare`` gets ``scale=root`` (no scaled copies)."""
    est = ka.create(name, num_features=16, seed=0).eval()
    q, k, v = _inputs(1.0, 1.0, torch.float32, d=16)
    seen: list[tuple] = []
    attend = FeatureMapAttention._attend_features
    prepare = TrigSoftmaxFeatures.prepare

    def spy_attend(self, q_, k_, v_, causal_, mask, root):  # type: ignore[no-untyped-def]
        seen.append(("attend", q_ is q and k_ is k, root))
        return attend(self, q_, k_, v_, causal_, mask, root)

    def spy_prepare(self, q_, k_, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(("prepare", q_ is q and k_ is k, kwargs.get("scale")))
        return prepare(self, q_, k_, **kwargs)

    monkeypatch.setattr(FeatureMapAttention, "_attend_features", spy_attend)
    monkeypatch.setattr(TrigSoftmaxFeatures, "prepare", spy_prepare)
    out = est(q, k, v, causal=causal)
    root = 16**-0.25
    assert seen == [("attend", True, root), ("prepare", True, root)]
    monkeypatch.undo()
    # the same attention as with scaled copies handed to the map (scale 1)
    ref = FeatureMapAttention._attend(est, q * root, k * root, v, causal, None)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("scale", [None, 0.05])
@pytest.mark.parametrize("name", TRIG)
@pytest.mark.parametrize(("dtype", "rel"), [(torch.float32, 1e-4), (torch.float64, 1e-6), (torch.float16, 1e-2)])
def test_trig_softmax_bound_is_on_the_scaled_key_norm_with_the_scale_in_the_engine(
    name: str, dtype: torch.dtype, rel: float, scale: float | None
) -> None:
    """A key just inside the bound (in the scaled coordinates, the factor applied in the
    engine) is not refused, one just past it is, naming its scaled norm; the default
    d^(-1/4) and an explicit ``scale`` alike. Non-causal only: causal calls never raise."""
    est = ka.create(name, num_features=16, seed=0, scale=scale).eval()
    root = est._input_root(4)
    assert root != 1.0
    bound = _bound(dtype)
    q, k, v = _inputs(bound * (1 - rel), root, dtype)
    est(q, k, v)  # no DomainError
    q, k, v = _inputs(bound * (1 + rel), root, dtype)
    with pytest.raises(DomainError, match=rf"k: .*\|\|k\|\| <= {bound:.4g}.*got max \|\|k\|\| = ") as info:
        est(q, k, v)
    got = float(str(info.value).split("got max ||k|| = ")[1].split(" ")[0])
    assert got == pytest.approx(bound * (1 + rel), rel=1e-3)  # the scaled norm, to the message's 4 digits
    assert est(q, k, v, causal=True)[:, :, 4:].isnan().all()  # causal: not refused, NaN from the key on


@pytest.mark.parametrize("name", TRIG)
def test_trig_softmax_exact_test_still_leaves_out_padded_and_non_finite_keys(name: str) -> None:
    """A padded key past the bound, or a NaN key, sends the one-reduction screen to the
    exact test, which leaves them out; with a finite key past the bound as well, the
    call is refused."""
    est = ka.create(name, num_features=16, seed=0).eval()
    root = est._input_root(4)
    bound = _bound(torch.float32)
    q, k, v = _inputs(bound * 1.5, root, torch.float32)
    mask = torch.zeros(1, 9, dtype=torch.bool)
    mask[:, 4] = True
    assert torch.isfinite(est(q, k, v, key_padding_mask=mask)).all()
    nan = k.clone()
    nan[:, :, 4] = float("nan")
    assert est(q, nan, v).isnan().all()  # quarantined as before, not refused
    nan[:, :, 2] = bound * 1.5 / root / 2.0
    with pytest.raises(DomainError, match=r"k: "):
        est(q, nan, v)


def test_trig_softmax_prepare_reads_nothing_back_while_dynamo_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    fm = TrigSoftmaxFeatures(4, 8)
    q, k, _ = _inputs(100.0, 0.5, torch.float32)
    with pytest.raises(DomainError):
        fm.prepare(q, k, scale=0.5)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    fm.prepare(q, k, scale=0.5)  # not refused, nothing read back


def test_a_subclass_overriding_prepare_keeps_the_scaled_copies_and_no_scale() -> None:
    """A subclass written before the flag (its own ``prepare(q, k, *, key_padding_mask,
    causal)`` calling ``super()``) inherits no promise: it is given the scaled keys and
    no ``scale`` (it failed with "unexpected keyword argument 'scale'", and a subclass
    reading the keys saw them unscaled)."""
    seen: list[float] = []

    class Custom(TrigSoftmaxFeatures):
        name = "trig-softmax-custom-test"

        def prepare(self, q, k, *, key_padding_mask=None, causal=False):  # type: ignore[no-untyped-def]
            seen.append(float(k.norm(dim=-1).max()))
            super().prepare(q, k, key_padding_mask=key_padding_mask, causal=causal)

    est = FeatureMapAttention(Custom(num_features=8), seed=0)
    q, k, v = _inputs(1.0, 4**-0.25, torch.float64)
    out = est(q, k, v)
    root = 4**-0.25
    assert seen and abs(seen[0] - float((k * root).norm(dim=-1).max())) < 1e-9
    ref = FeatureMapAttention(TrigSoftmaxFeatures(num_features=8), seed=0)(q, k, v)
    torch.testing.assert_close(out, ref)


def test_the_flag_beside_a_prepare_without_scale_is_refused_by_name() -> None:
    """A map that declares ``prepare_takes_scale = True`` but whose ``prepare`` takes no
    ``scale`` gets a PluginError naming the flag (a raw TypeError from the call before)."""
    from kernelattn_core.toolkit import PluginError

    class Broken(TrigSoftmaxFeatures):
        name = "trig-softmax-broken-test"
        prepare_takes_scale = True

        def prepare(self, q, k, *, key_padding_mask=None, causal=False):  # type: ignore[no-untyped-def]
            return None

    est = FeatureMapAttention(Broken(num_features=8), seed=0)
    q, k, v = _inputs(1.0, 4**-0.25, torch.float64)
    message = "Broken declares prepare_takes_scale = True but its prepare takes no scale keyword"
    with pytest.raises(PluginError, match=message):
        est(q, k, v)
