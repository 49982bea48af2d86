"""The conformance kit: any registered class becomes a parametrised test suite.

A plugin author adds one file to the plugin's tests::

    from kernelattn_core.testing import conformance_tests

    test_conformance = conformance_tests("myplugin")  # a plugin name or class names

and gets, for every class the plugin registers, **verify plus structure**:

* the structural cases: the interface contract (shapes, float32/float64 preserved,
  device moves, batch consistency, determinism under a fixed generator, ``state_dict``
  round trip, redraw semantics), the capability flags checked against behaviour (a
  class flagged positive never yields a non-positive feature), half precision (float16
  and bfloat16 attention finite and close to float32);
* one case per claim ``kernelattn verify`` runs on the class (:func:`~kernelattn_core.verify.claims_of`):
  the declared ones, those its flags imply, and the **engine claims** every estimator and
  feature map gets (EN001: outputs and gradients against the quadratic reference from the
  class's own features, so an estimator that overrides ``_attend`` is checked against
  what it should compute; EN002 causality; EN003 padding), at the level given by
  ``pytest --kernelattn-level quick|full`` (quick by default: a claim's option grid runs
  its declared options and first point, full runs every point).

A claim in a deprecated form (spec ``1.1``: FM002 on a log-space map) emits a
:class:`~kernelattn_core.claims.spec.ClaimDeprecationWarning` and is checked in its
meaningful form, so a plugin written against an earlier spec keeps passing.
An estimator that is causal only declares ``supports_noncausal = False`` (class data,
read with default ``True``): the kit then calls it with ``causal=True`` and ``N == M``
and requires ``causal=False`` to raise an :class:`~kernelattn_core.errors.InputError`
naming ``causal``.
:func:`fuzz_tests` adds the property-based reliability suite
(:mod:`kernelattn_core.testing.fuzz`).

:func:`conformance_cases` gives the same checks as plain callables for use outside
pytest.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InputError
from ..interfaces import AttentionEstimator, FeatureMap, Kernel, Normalizer
from ..registry import Entry, Registry, get_registry

HEAD_DIM = 8


@dataclass(frozen=True)
class Case:
    """One conformance check of one registered class."""

    target: str
    check: str
    run: Callable[[str], None]  # level -> None; raises AssertionError on failure

    @property
    def id(self) -> str:
        return f"{self.target}-{self.check}"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(*shape: int, seed: int = 0, scale: float = 0.3, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed), dtype=torch.float64) * scale).to(dtype)


def _build_map(cls: type[FeatureMap], seed: int = 0, num_features: int = 16) -> FeatureMap:
    fm = cls(num_features=num_features) if cls.has_budget else cls()
    fm.build(HEAD_DIM, generator=_gen(seed))
    return fm


def _feats(fm: FeatureMap, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return fm.query(x), fm.key(x)


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...], what: str) -> None:
    for x, y in zip(a, b):
        assert torch.equal(x, y), f"{what}: max abs difference {float((x - y).abs().max()):.3g}"


# --------------------------------------------------------------------------- feature maps
def _feature_map_cases(entry: Entry) -> list[Case]:
    cls: type[FeatureMap] = entry.cls

    def shapes(level: str) -> None:
        fm = _build_map(cls).double()
        x = _inputs(2, 3, 5, HEAD_DIM)
        qf, kf = _feats(fm, x)
        assert isinstance(fm.feature_dim, int) and fm.feature_dim > 0
        assert qf.shape == kf.shape == (2, 3, 5, fm.feature_dim), (qf.shape, fm.feature_dim)

    def dtypes(level: str) -> None:
        fm = _build_map(cls)
        assert _feats(fm, _inputs(4, HEAD_DIM, dtype=torch.float32))[0].dtype == torch.float32
        fm = fm.double()
        assert _feats(fm, _inputs(4, HEAD_DIM))[0].dtype == torch.float64
        assert all(b.dtype == torch.float64 for b in fm.buffers() if b.is_floating_point())

    def device_moves(level: str) -> None:
        fm = _build_map(cls).to("meta")
        tensors = list(fm.parameters()) + list(fm.buffers())
        assert all(t.device.type == "meta" for t in tensors), "a parameter or buffer stayed behind on .to()"
        if torch.cuda.is_available():  # pragma: no cover - exercised on GPU machines
            ref = _build_map(cls).double()
            x = _inputs(4, HEAD_DIM)
            _same(tuple(t.cpu() for t in _feats(ref.cuda(), x.cuda())), _feats(ref.cpu(), x), "cuda vs cpu")

    def batch_consistency(level: str) -> None:
        fm = _build_map(cls).double()
        x = _inputs(6, HEAD_DIM, seed=1)
        whole = _feats(fm, x)
        for i in (0, 3, 5):
            one = _feats(fm, x[i : i + 1])
            for w, o in zip(whole, one):
                torch.testing.assert_close(w[i : i + 1], o, rtol=1e-12, atol=1e-14)

    def determinism(level: str) -> None:
        x = _inputs(4, HEAD_DIM)
        _same(_feats(_build_map(cls, 5).double(), x), _feats(_build_map(cls, 5).double(), x), "same generator")

    def state_dict_round_trip(level: str) -> None:
        fm = _build_map(cls, 3).double()
        buffer = io.BytesIO()
        torch.save(fm.state_dict(), buffer)
        buffer.seek(0)
        fresh = (cls(num_features=16) if cls.has_budget else cls()).double()
        fresh.load_state_dict(torch.load(buffer))
        x = _inputs(4, HEAD_DIM)
        _same(_feats(fresh, x), _feats(fm, x), "state_dict round trip")

    def redraw_semantics(level: str) -> None:
        fm = _build_map(cls, 0).double()
        x = _inputs(4, HEAD_DIM)
        fm.redraw(generator=_gen(0))
        first = _feats(fm, x)
        fm.redraw(generator=_gen(0))
        _same(_feats(fm, x), first, "redraw with the same generator seed")
        fm.redraw(generator=_gen(1))
        changed = not all(torch.equal(a, b) for a, b in zip(_feats(fm, x), first))
        assert changed == cls.random, f"random={cls.random} but a redraw {'changed' if changed else 'kept'} features"

    def positive_flag(level: str) -> None:
        fm = _build_map(cls).double()
        x = _inputs(64, HEAD_DIM, scale=1.0)
        with torch.no_grad():
            for seed in range(5):
                fm.redraw(generator=_gen(seed))
                for raw in (fm.raw_features(x, query=True), fm.raw_features(x, query=False)):
                    feats = raw.exp() if cls.log_space else raw
                    if cls.positive:
                        assert bool((feats > 0).all()), f"flagged positive, min feature {float(feats.min()):.3g}"
                    assert bool(torch.isfinite(raw).all() or cls.log_space), "non-finite features"

    def log_space_consistency(level: str) -> None:
        fm = _build_map(cls).double()
        x = _inputs(4, HEAD_DIM)
        if cls.log_space:
            torch.testing.assert_close(fm.query_log(x).exp(), fm.query(x))
            torch.testing.assert_close(fm.key_log(x).exp(), fm.key(x))
        else:
            try:
                fm.query_log(x)
            except InputError:
                return
            raise AssertionError("query_log must refuse a map that is not log_space")

    checks = [
        shapes,
        dtypes,
        device_moves,
        batch_consistency,
        determinism,
        state_dict_round_trip,
        redraw_semantics,
        positive_flag,
        log_space_consistency,
    ]
    return [Case(entry.name, f.__name__, f) for f in checks] + _attention_cases(entry)


# --------------------------------------------------------------------------- estimators (and maps through create)
def _make_estimator(name: str, has_budget: bool) -> AttentionEstimator:
    from ..api import create

    return create(name, **({"num_features": 16} if has_budget else {}))


def _attention_cases(entry: Entry) -> list[Case]:
    has_budget = bool(getattr(entry.cls, "has_budget", False))
    supports_causal = bool(getattr(entry.cls, "supports_causal", True))
    # a causal-only class (``supports_noncausal = False``, e.g. a gated recurrence) is
    # exercised causally with N == M, and must refuse causal=False with an InputError
    noncausal = bool(getattr(entry.cls, "supports_noncausal", True))
    mode: dict[str, bool] = {} if noncausal else {"causal": True}

    def keys(m: int, n: int) -> int:
        return m if noncausal else n

    def est() -> AttentionEstimator:
        torch.manual_seed(0)
        return _make_estimator(entry.name, has_budget).double().eval()

    def attention_shapes_and_dtypes(level: str) -> None:
        m = keys(9, 7)
        q, k, v = _inputs(2, 2, 7, HEAD_DIM, seed=1), _inputs(2, 2, m, HEAD_DIM, seed=2), _inputs(2, 2, m, 3, seed=3)
        e = est()
        with torch.no_grad():
            out = e(q, k, v, **mode)
            assert out.shape == (2, 2, 7, 3) and out.dtype == torch.float64 and torch.isfinite(out).all()
            torch.manual_seed(0)
            e32 = _make_estimator(entry.name, has_budget).eval()
            out32 = e32(q.float(), k.float(), v.float(), **mode)
            assert out32.dtype == torch.float32 and torch.isfinite(out32).all()

    def padding_excluded(level: str) -> None:
        n = keys(6, 8)
        q, k, v = _inputs(2, 2, n, HEAD_DIM, seed=4), _inputs(2, 2, 8, HEAD_DIM, seed=5), _inputs(2, 2, 8, 3, seed=6)
        mask = torch.zeros(2, 8, dtype=torch.bool)
        mask[:, 5:] = True
        if not noncausal:
            mask[:, 2] = True  # a padded key that later (causal) rows would otherwise see
        e = est()
        with torch.no_grad():
            out = e(q, k, v, key_padding_mask=mask, **mode)
            k2, v2 = k.clone(), v.clone()
            k2[mask[:, None, :, None].expand_as(k2)] = 0.9
            v2[mask[:, None, :, None].expand_as(v2)] = 1e3
            torch.testing.assert_close(e(q, k2, v2, key_padding_mask=mask, **mode), out, rtol=1e-9, atol=1e-9)

    def causal_prefix_invariance(level: str) -> None:
        q, k, v = (
            _inputs(1, 2, 10, HEAD_DIM, seed=7),
            _inputs(1, 2, 10, HEAD_DIM, seed=8),
            _inputs(1, 2, 10, 3, seed=9),
        )
        e = est()
        with torch.no_grad():
            if not noncausal:
                try:
                    e(q, k, v, causal=False)
                except InputError as exc:
                    assert "causal" in str(exc), f"the refusal of causal=False does not name 'causal': {exc}"
                else:
                    raise AssertionError("supports_noncausal=False but causal=False did not raise InputError")
            if not supports_causal:
                try:
                    e(q, k, v, causal=True)
                except InputError:
                    return
                raise AssertionError("supports_causal=False but causal=True did not raise InputError")
            full = e(q, k, v, causal=True)
            for cut in (1, 4, 7):
                part = e(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], causal=True)
                torch.testing.assert_close(full[:, :, :cut], part, rtol=1e-9, atol=1e-10)

    def eval_determinism_and_state_dict(level: str) -> None:
        q, k, v = _inputs(1, 2, 6, HEAD_DIM, seed=10), _inputs(1, 2, 6, HEAD_DIM, seed=11), _inputs(1, 2, 6, 3)
        e = est()
        with torch.no_grad():
            first = e(q, k, v, **mode)
            assert torch.equal(e(q, k, v, **mode), first), "eval-mode outputs change between calls"
            buffer = io.BytesIO()
            torch.save(e.state_dict(), buffer)
            buffer.seek(0)
            torch.manual_seed(12345)  # a different seed: only the state dict can make them agree
            fresh = _make_estimator(entry.name, has_budget).double().eval()
            fresh.load_state_dict(torch.load(buffer))
            assert torch.equal(fresh(q, k, v, **mode), first), "state_dict round trip changed the output"

    def half_precision(level: str) -> None:
        """float16 and bfloat16 inputs give finite outputs of the same dtype, close to the
        float32 result of the same module (long key sums must not overflow float16)."""
        g = _gen(13)
        q, k, v = (torch.randn(1, 2, 256, HEAD_DIM, generator=g) * 0.5 for _ in range(3))
        v = 200 + 50 * v  # a sum over 256 keys of such values overflows float16 unless accumulated wider
        torch.manual_seed(0)
        e = _make_estimator(entry.name, has_budget).eval()
        causal = supports_causal
        with torch.no_grad():
            ref = e(q, k, v, causal=causal)
            for dtype in (torch.float16, torch.bfloat16):
                out = e(q.to(dtype), k.to(dtype), v.to(dtype), causal=causal)
                assert out.dtype == dtype, f"{dtype} input gave {out.dtype}"
                assert bool(torch.isfinite(out).all()), f"non-finite output in {dtype}"
                rel = float((out.float() - ref).norm() / ref.norm())
                assert rel < 5e-2, f"{dtype}: relative error {rel:.3g} against float32"

    checks = [
        attention_shapes_and_dtypes,
        padding_excluded,
        causal_prefix_invariance,
        eval_determinism_and_state_dict,
        half_precision,
    ]
    return [Case(entry.name, f.__name__, f) for f in checks]


# --------------------------------------------------------------------------- kernels and normalizers
def _kernel_cases(entry: Entry) -> list[Case]:
    cls: type[Kernel] = entry.cls

    def kernel_matrix(level: str) -> None:
        kern = cls()
        q, k = _inputs(2, 3, 4, HEAD_DIM, seed=1), _inputs(2, 3, 5, HEAD_DIM, seed=2)
        out = kern(q, k)
        assert out.shape == (2, 3, 4, 5) and out.dtype == torch.float64 and torch.isfinite(out).all()
        assert kern(q.float(), k.float()).dtype == torch.float32
        torch.testing.assert_close(kern(k, q), out.transpose(-1, -2), rtol=1e-12, atol=1e-14)  # symmetric
        if cls.positive:
            assert bool((out > 0).all()), "flagged positive"

    return [Case(entry.name, "kernel_matrix", kernel_matrix)]


def _normalizer_cases(entry: Entry) -> list[Case]:
    cls: type[Normalizer] = entry.cls

    def per_query_invariance(level: str) -> None:
        norm = cls().double()
        num, den = _inputs(2, 2, 5, 3, seed=1), _inputs(2, 2, 5, seed=2).abs() + 0.1
        c = _inputs(2, 2, 5, seed=3).abs() + 0.5
        with torch.no_grad():
            out = norm.post(norm.normalize(num, den))
            scaled = norm.post(norm.normalize(num * c.unsqueeze(-1), den * c))
        torch.testing.assert_close(scaled, out, rtol=1e-10, atol=1e-12)
        assert out.shape == num.shape

    return [Case(entry.name, "per_query_invariance", per_query_invariance)]


# --------------------------------------------------------------------------- claims
def _claim_cases(entry: Entry) -> list[Case]:
    """One case per claim verify runs on ``entry`` (grids expanded at the run's level)."""
    from ..verify import check_claim, claims_of

    cases = []
    for i, claim in enumerate(claims_of(entry)):

        def run(level: str, claim: Any = claim) -> None:
            result = check_claim(entry, claim, level)
            assert result.passed, f"{result.rule} {result.claim}: {result.numbers}"

        cases.append(Case(entry.name, f"claim-{claim.rule}-{i}", run))
    return cases


def conformance_cases(*names: str, registry: Registry | None = None, claims: bool = True) -> list[Case]:
    """Every conformance check of the named plugins or classes."""
    from ..verify import select

    registry = registry or get_registry()
    cases: list[Case] = []
    for entry in select(list(names), registry):
        if entry.kind == "feature_map":
            cases += _feature_map_cases(entry)
        elif entry.kind == "estimator":
            if entry.name == "feature-map":
                continue  # the generic wrapper is exercised through every feature map
            cases += _attention_cases(entry)
        elif entry.kind == "kernel":
            cases += _kernel_cases(entry)
        elif entry.kind == "normalizer":
            cases += _normalizer_cases(entry)
        if claims:
            cases += _claim_cases(entry)
    if not cases:  # never "0 passed": a kit that checks nothing must fail
        from ..errors import UnknownNameError

        raise UnknownNameError(f"conformance_tests{tuple(names)!r}: no class to check (nothing registered under it)")
    return cases


def conformance_tests(*names: str, claims: bool = True) -> Callable[..., None]:
    """A pytest test function parametrised over :func:`conformance_cases`."""
    import pytest

    cases = conformance_cases(*names, claims=claims)

    @pytest.mark.parametrize("case", cases, ids=[c.id for c in cases])
    def test_conformance(case: Case, request: pytest.FixtureRequest) -> None:
        level = request.config.getoption("--kernelattn-level", default="quick")
        case.run(level)

    return test_conformance


def fuzz_tests(*names: str, properties: tuple[str, ...] = ()) -> Callable[..., None]:
    """The reliability fuzz suite (:mod:`kernelattn_core.testing.fuzz`) for the named
    plugins or classes: a plugin adds ``test_fuzz = fuzz_tests("myplugin")`` beside
    ``test_conformance`` and its classes are fuzzed exactly as the core's are (masks with
    non-finite padding, causal prefix invariance, dtypes up to scaled norm 10, empty
    shapes, replica agreement, the bad-input catalogue). Needs ``hypothesis``."""
    from .fuzz import fuzz_tests as _fuzz_tests

    return _fuzz_tests(*names, properties=properties)


__all__ = ["Case", "conformance_cases", "conformance_tests", "fuzz_tests"]
