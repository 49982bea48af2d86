"""Mutation meta-test: every claim kind can fail.

For each claim kind (each checker in :func:`kernelattn_core.verify._checkers`), a
subject that satisfies the claim passes, and the same subject with a planted defect
(a scaled weight, a shifted coefficient, a flipped sign, a dropped normalisation)
fails. A claim kind without a mutation here fails :func:`test_every_claim_kind_has_a_mutation`:
a claim no mutation can fail must be removed or rewritten.

Engine claims (EN001-EN003) are mutated in the engine itself (:data:`ENGINE_CASES`: a
causal mask off by one, a gradient term dropped, group sums left at different
stabilisers, a padding mask shifted), the way a change to the engine would break it; the
claims that read non-default options (:data:`OPTION_CASES`) are mutated where only that
option shows the defect (``A^-1`` for ``A^-T`` with a non-symmetric ``A``, global tokens
dropped, a bias or a power ignored at trained-like parameters), and each such mutant is
also shown to pass the class's claims at default options, which therefore could not see it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core import claims as C
from kernelattn_core.registry import Entry
from kernelattn_core.verify import _checkers, check_claim, claims_of, expand

from . import toy_plugin, verify_plugin


@pytest.fixture
def reg(monkeypatch: pytest.MonkeyPatch) -> ka.Registry:
    import kernelattn_core.registry as registry_module

    registry = ka.Registry(autoload=True)
    registry.register_plugin(toy_plugin, "toys")
    registry.register_plugin(verify_plugin, "verify-tests")
    monkeypatch.setattr(registry_module, "_REGISTRY", registry)
    return registry


def _mutant(entry: Entry, name: str, **body: Any) -> Entry:
    """The entry's class with methods overridden (a planted defect), as an unregistered entry."""
    cls = type(f"Mutant{entry.cls.__name__}", (entry.cls,), body)
    return Entry(entry.name + f"[{name}]", entry.kind, cls, entry.plugin)


def _claim(entry: Entry, rule: str, **match: Any) -> C.Claim:
    for claim in getattr(entry.cls, "claims", ()):
        if claim.rule == rule and all(getattr(claim, k, None) == v for k, v in match.items()):
            return claim
    raise LookupError(f"{entry.name} declares no {rule} claim matching {match}")


# ----------------------------------------------------------------------------- mutations
def _scaled_log_features(entry: Entry) -> Entry:
    def _features(self, x, is_query):  # type: ignore[no-untyped-def]
        return entry.cls._features(self, x, is_query) + (math.log(1.03) if is_query else 0.0)

    return _mutant(entry, "query weights x1.03", _features=_features)


def _scaled_log_features_big(entry: Entry) -> Entry:
    def _features(self, x, is_query):  # type: ignore[no-untyped-def]
        return entry.cls._features(self, x, is_query) + (math.log(1.2) if is_query else 0.0)

    return _mutant(entry, "query weights x1.2", _features=_features)


def _flipped_feature(entry: Entry) -> Entry:
    def _features(self, x, is_query):  # type: ignore[no-untyped-def]
        f = entry.cls._features(self, x, is_query).clone()
        f[..., 0] = -f[..., 0]
        return f

    return _mutant(entry, "feature 0 sign flipped", _features=_features)


def _scaled_rmf_weight(entry: Entry) -> Entry:
    def _weights(self, degrees):  # type: ignore[no-untyped-def]
        w = entry.cls._weights(self, degrees).clone()
        return torch.where(degrees == 3, w * 1.001, w)

    return _mutant(entry, "weight of degree 3 x1.001", _weights=_weights)


def _shifted_coefficient(entry: Entry) -> Entry:
    def coefficient(self, n):  # type: ignore[no-untyped-def]
        a = entry.cls.coefficient(self, n)
        return a + Fraction(1, 10**6) if n == 4 else a

    return _mutant(entry, "a_4 + 1e-6", coefficient=coefficient)


def _flipped_coefficient(entry: Entry) -> Entry:
    def coefficient(self, n):  # type: ignore[no-untyped-def]
        a = entry.cls.coefficient(self, n)
        return -a if n == 3 else a

    return _mutant(entry, "a_3 sign flipped", coefficient=coefficient)


def _shifted_log_table(entry: Entry) -> Entry:
    def log_coefficients(self, n_max):  # type: ignore[no-untyped-def]
        out = entry.cls.log_coefficients(self, n_max).clone()
        out[4] += 1e-6
        return out

    return _mutant(entry, "runtime log a_4 + 1e-6", log_coefficients=log_coefficients)


def _scaled_f(entry: Entry) -> Entry:
    def f(self, t):  # type: ignore[no-untyped-def]
        return entry.cls.f(self, t) * (1 + 1e-7)

    return _mutant(entry, "f x(1 + 1e-7)", f=f)


def _scaled_kernel(factor: float) -> Callable[[Entry], Entry]:
    def mutate(entry: Entry) -> Entry:
        def _evaluate(self, q, k):  # type: ignore[no-untyped-def]
            return entry.cls._evaluate(self, q, k) * factor

        return _mutant(entry, f"K x{factor}", _evaluate=_evaluate)

    return mutate


def _scaled_density(entry: Entry) -> Entry:
    def spectral_density_mp(self, omega):  # type: ignore[no-untyped-def]
        return entry.cls.spectral_density_mp(self, omega) * (1 + 1e-6)

    return _mutant(entry, "p(w) x(1 + 1e-6)", spectral_density_mp=spectral_density_mp)


def _scaled_output(factor: float, offset: float = 0.0) -> Callable[[Entry], Entry]:
    def mutate(entry: Entry) -> Entry:
        def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
            return entry.cls._attend(self, q, k, v, causal, key_padding_mask) * factor + offset

        return _mutant(entry, f"output x{factor} + {offset}", _attend=_attend)

    return mutate


def _scaled_queries(factor: float) -> Callable[[Entry], Entry]:
    def mutate(entry: Entry) -> Entry:
        def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
            return entry.cls._attend(self, q * factor, k, v, causal, key_padding_mask)

        return _mutant(entry, f"queries x{factor:.3g}", _attend=_attend)

    return mutate


# Each case: (rule, subject name, claim selector, mutation of the class or None, mutation of the claim or None)
CASES: list[tuple[str, str, Callable[[Entry], C.Claim], Any, Any]] = [
    ("FM001", "checked-prf", lambda e: C.UnbiasedKernelEstimate(dims=(8,)), _scaled_log_features, None),
    ("FM002", "elu", lambda e: C.PositiveFeatures(), _flipped_feature, None),
    ("FM003", "checked-prf", lambda e: _claim(e, "FM003"), _scaled_log_features_big, None),
    ("FM004", "checked-prf", lambda e: _claim(e, "FM004"), _scaled_log_features_big, None),
    ("FM005", "rmf", lambda e: _claim(e, "FM005", options={"kernel": "inv"}), _scaled_rmf_weight, None),
    (
        "SP001",
        "rmf",
        lambda e: _claim(e, "SP001", start=1),
        None,
        lambda c: dataclasses.replace(c, pmf=lambda n: c.pmf(n) * 2),  # drop a normalisation
    ),
    (
        "SP001",
        "rmf",
        lambda e: _claim(e, "SP001", start=1),
        None,
        lambda c: dataclasses.replace(c, runtime=_wrong_sampler(c.runtime)),  # the sampler draws another law
    ),
    ("KN001", "exp", lambda e: C.MaclaurinCoefficients(order=8), _shifted_coefficient, None),
    ("KN002", "exp", lambda e: C.NonNegativeCoefficients(order=8), _flipped_coefficient, None),
    ("KN002", "exp", lambda e: C.NonNegativeCoefficients(order=8), _shifted_log_table, None),
    ("KN003", "exp", lambda e: C.KernelMatchesExpression(), _scaled_f, None),
    ("KN004", "gaussian", lambda e: _claim(e, "KN004"), _scaled_kernel(1 + 1e-7), None),
    ("KN005", "laplacian", lambda e: C.SpectralDensityIntegral(), _scaled_density, None),
    ("KN006", "gaussian", lambda e: C.PositiveDefinite(), _scaled_kernel(-1.0), None),
    (
        "HP001",
        "checked-prf",
        lambda e: _claim(e, "HP001"),
        None,
        lambda c: dataclasses.replace(c, evaluate=_perturbed_identity(c.evaluate)),
    ),
    ("AT001", "toy-ra", lambda e: _claim(e, "AT001"), _scaled_output(1.25), None),
    ("AT002", "toy-ra", lambda e: _claim(e, "AT002"), _scaled_output(1.0, 0.2), None),
    # the case: a bias that stays flat while the variance falls (queries scaled by
    # d^-1/4 twice: softmax of the wrong temperature is the limit), and a fixed offset of 0.02
    ("AT002", "consistent-prf", lambda e: _claim(e, "AT002"), _scaled_queries(8**-0.25), None),
    ("AT002", "consistent-prf", lambda e: _claim(e, "AT002"), _scaled_output(1.0, 0.02), None),
    ("RT001", "identified-prf", lambda e: _claim(e, "RT001", expect="pass"), _scaled_log_features, None),
    (
        "AT002",
        "consistent-prf",
        lambda e: _claim(e, "AT002"),
        None,
        lambda c: dataclasses.replace(c, biased_at_finite_budget=False),  # a biased estimator claiming no bias
    ),
]


def _wrong_sampler(runtime: Any) -> Any:
    def wrapped() -> Any:
        law, values = runtime()

        class Shifted:
            def pmf(self, n: int) -> float:
                return law.pmf(n)

            def sample(self, u: torch.Tensor) -> torch.Tensor:
                return law.sample(u**1.05)  # a slightly different law than pmf() says

        return Shifted(), values

    return wrapped


def _perturbed_identity(evaluate: Any) -> Any:
    def wrapped(dps: int) -> Any:
        value, target, note = evaluate(dps)
        import mpmath

        return value * (1 + mpmath.mpf(10) ** -(dps // 2)), target, note

    return wrapped


RULE_OF = {cls: cls.rule for cls in _checkers()}


# ----------------------------------------------------------------------------- engine mutations
def _implied(rule: str) -> Callable[[Entry], C.Claim]:
    return lambda e: next(c for c in claims_of(e) if c.rule == rule)


def _diagonal_dropped(mp: pytest.MonkeyPatch) -> None:
    """Causal engine: the in-chunk mask excludes the diagonal (row t misses key t)."""
    from kernelattn_core.engine import chunked

    mp.setattr(chunked, "_tri", lambda c, device: torch.ones(c, c, dtype=torch.bool, device=device).tril(-1))


def _future_in_chunk(mp: pytest.MonkeyPatch) -> None:
    """Causal engine: the in-chunk mask lets every row see the whole chunk."""
    from kernelattn_core.engine import chunked

    mp.setattr(chunked, "_tri", lambda c, device: torch.ones(c, c, dtype=torch.bool, device=device))


def _k_gradient_without_states(mp: pytest.MonkeyPatch) -> None:
    """Causal engine, backward only: the key gradient loses the term through later chunks'
    states (outputs stay right)."""
    from kernelattn_core.engine import chunked

    original = chunked._Block.backward

    def backward(self, o_bar, g_out):  # type: ignore[no-untyped-def]
        q_bar, _, v_bar, g_in = original(self, o_bar, g_out)
        oc = o_bar.reshape(self.vc.shape)
        pm = self.masked(oc @ self.vc.transpose(-1, -2))
        local = (pm.transpose(-1, -2) @ self.qc).flatten(0, 2)  # the in-chunk part only
        return q_bar, local, v_bar, g_in

    mp.setattr(chunked._Block, "backward", backward)


def _groups_not_restated(mp: pytest.MonkeyPatch) -> None:
    """Non-causal engine: each key group's sums stay at the group's own stabiliser instead
    of being restated at the running maximum (invisible with one group)."""
    from kernelattn_core.engine import grouped

    original = grouped._key_group

    def key_group(call, k, v, g0, g1, c, *, grow):  # type: ignore[no-untyped-def]
        if not grow:
            return original(call, k, v, g0, g1, c, grow=grow)
        fk, vv, own, *rest = original(call, k, v, g0, g1, torch.full_like(c, float("-inf")), grow=True)
        return (fk, vv, torch.maximum(c, own), *rest)

    mp.setattr(grouped, "_key_group", key_group)


def _plain_scan_inclusive(mp: pytest.MonkeyPatch) -> None:
    """Causal engine, plain features: the state entering a chunk already holds the chunk."""
    from kernelattn_core.engine import chunked

    original = chunked._scan

    def scan(u, decay, s0):  # type: ignore[no-untyped-def]
        if decay is not None:
            return original(u, decay, s0)
        inclusive = u.cumsum(2) + s0.unsqueeze(2)
        return inclusive, inclusive[:, :, -1].clone()

    mp.setattr(chunked, "_scan", scan)


def _padding_mask_shifted(mp: pytest.MonkeyPatch) -> None:
    """Both engines: each group reads the padding mask one position off."""
    from kernelattn_core.engine import grouped

    def mask(self, g0, g1):  # type: ignore[no-untyped-def]
        return None if self.key_padding_mask is None else self.key_padding_mask[:, g0:g1].roll(1, dims=1)

    mp.setattr(grouped._Call, "mask", mask)


# Each case: (rule, subject name, claim selector, patch of the engine)
ENGINE_CASES: list[tuple[str, str, Callable[[Entry], C.Claim], Callable[[pytest.MonkeyPatch], None]]] = [
    ("EN001", "toy-prf", _implied("EN001"), _diagonal_dropped),
    ("EN001", "toy-prf", _implied("EN001"), _k_gradient_without_states),
    ("EN001", "toy-prf", _implied("EN001"), _groups_not_restated),
    ("EN001", "toy-trig", _implied("EN001"), _plain_scan_inclusive),
    ("EN002", "toy-prf", _implied("EN002"), _future_in_chunk),
    ("EN003", "toy-prf", _implied("EN003"), _padding_mask_shifted),
]


@pytest.mark.parametrize("case", ENGINE_CASES, ids=[f"{c[0]}-{c[1]}-{c[3].__name__}" for c in ENGINE_CASES])
def test_engine_claim_passes_and_the_mutated_engine_fails(
    reg: ka.Registry, monkeypatch: pytest.MonkeyPatch, case: Any
) -> None:
    rule, name, select, patch = case
    entry = reg.get(name)
    claim = select(entry)
    assert claim.rule == rule
    good = check_claim(entry, claim, "quick")
    assert good.verdict == "pass", good
    with monkeypatch.context() as mp:
        patch(mp)
        bad = check_claim(entry, claim, "quick")
    assert bad.verdict == "fail", bad
    assert "error" not in bad.numbers, f"the mutant crashed the checker instead of failing it: {bad.numbers}"


# ----------------------------------------------------------------------------- option mutations
def _key_transform_transposed(entry: Entry) -> Entry:
    """CEXP keys multiplied by A^-1 instead of A^-T (the same for every symmetric A)."""

    def transform(self, x, *, query):  # type: ignore[no-untyped-def]
        if query or self.diagonal or self.rule == "identity":
            return entry.cls.transform(self, x, query=query)
        return x @ self.matrix_k.to(dtype=x.dtype, device=x.device)

    return _mutant(entry, "keys by A^-1", transform=transform)


def _global_tokens_dropped(entry: Entry) -> Entry:
    """sliding-window: the blocked path forgets the global tokens (they enter through the
    features like any far key)."""

    def _attend_finite(self, q, k, v, causal, key_padding_mask, *args, **kwargs):  # type: ignore[no-untyped-def]
        saved, self.global_tokens = self.global_tokens, 0
        try:
            return entry.cls._attend_finite(self, q, k, v, causal, key_padding_mask, *args, **kwargs)
        finally:
            self.global_tokens = saved

    return _mutant(entry, "global tokens dropped", _attend_finite=_attend_finite)


def _key_bias_is_query_bias(entry: Entry) -> Entry:
    """hedgehog: the key side uses the query's bias (equal at initialisation, both zero)."""

    def _features(self, x, is_query):  # type: ignore[no-untyped-def]
        saved = self.bias_k
        try:
            if not is_query:
                self.bias_k = self.bias_q
            return entry.cls._features(self, x, is_query)
        finally:
            self.bias_k = saved

    return _mutant(entry, "key bias = query bias", _features=_features)


def _power_ignored(entry: Entry) -> Entry:
    """ppSBN: the post-scaling ignores beta (right at beta = 1, its initial value)."""

    def post(self, out):  # type: ignore[no-untyped-def]
        return self.gamma.to(out.dtype) * out

    return _mutant(entry, "beta ignored", post=post)


def _laplacian_scale_inverted(mp: pytest.MonkeyPatch) -> None:
    """rff's Laplacian sampler: the lengthscale multiplies the Cauchy frequencies instead
    of dividing them (right at lengthscale 1)."""
    import math as m

    from kernelattn_fourier.kernels import LaplacianKernel

    def sample_frequencies(self, num, dim, draw):  # type: ignore[no-untyped-def]
        return torch.tan(m.pi * (draw("uniform", (num, dim)) - 0.5)) * self.lengthscale

    mp.setattr(LaplacianKernel, "sample_frequencies", sample_frequencies)


def _point(
    rule_id: str, options: dict[str, Any], where: Callable[[Any], bool] | None = None
) -> Callable[[Entry], C.Claim]:
    """The claim of ``rule_id`` (a grid point of it, at full level) whose options include
    ``options`` (and satisfy ``where``)."""

    def select(entry: Entry) -> C.Claim:
        for claim in getattr(entry.cls, "claims", ()):
            if claim.rule != rule_id or claim.expect != "pass":
                continue
            for point in expand(claim, "full"):
                found = all(k in point.options and _same(point.options[k], v) for k, v in options.items())
                if found and (where is None or where(point.options)):
                    return point
        raise LookupError(f"{entry.name} declares no {rule_id} claim at options {options}")

    return select


def _same(a: Any, b: Any) -> bool:
    return bool(torch.equal(a, b)) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b


# Each case: (rule, subject, selector of the claim at the non-default option, class mutation
# or None, engine patch or None, plugin module needed)
OPTION_CASES: list[tuple[str, str, Callable[[Entry], C.Claim], Any, Any, str]] = [
    (
        "FM001",
        "cexp",
        _point("FM001", {"rule": "fixed"}, lambda o: isinstance(o["matrix"], torch.Tensor) and o["matrix"].dim() == 2),
        _key_transform_transposed,
        None,
        "kernelattn_prf",
    ),
    (
        "EN001",
        "sliding-window",
        _point("EN001", {"global_tokens": 1}),
        _global_tokens_dropped,
        None,
        "kernelattn_hybrid",
    ),
    ("RT001", "hedgehog", _point("RT001", {"num_heads": 2}), _key_bias_is_query_bias, None, "kernelattn_hybrid"),
    ("RT001", "ppsbn", _point("RT001", {"post_form": "gamma_pow"}), _power_ignored, None, "kernelattn_maclaurin"),
    (
        "FM001",
        "rff",
        _point("FM001", {"kernel": "laplacian", "lengthscale": 1.6}),
        None,
        _laplacian_scale_inverted,
        "kernelattn_fourier",
    ),
]


@pytest.mark.parametrize("case", OPTION_CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(OPTION_CASES)])
def test_option_claim_sees_a_defect_the_default_options_hide(monkeypatch: pytest.MonkeyPatch, case: Any) -> None:
    rule, name, select, mutate_class, patch, module = case
    pytest.importorskip(module)
    entry = ka.get_registry().get(name)
    claim = select(entry)
    assert claim.rule == rule and not claim.grid
    good = check_claim(entry, claim, "quick")
    assert good.verdict == "pass", good
    bad_entry = mutate_class(entry) if mutate_class is not None else entry
    # the same claim at default options (and untrained parameters, no data fit)
    default = dataclasses.replace(claim, options={})
    for field_name, value in (("perturb", 0.0), ("setup", None)):
        if hasattr(default, field_name):
            default = dataclasses.replace(default, **{field_name: value})
    with monkeypatch.context() as mp:
        if patch is not None:
            patch(mp)
        bad = check_claim(bad_entry, claim, "quick")
        hidden = check_claim(bad_entry, default, "quick")
    assert bad.verdict == "fail" and "error" not in bad.numbers, bad
    assert hidden.verdict == "pass", hidden  # at default options the defect hides: only the option claim sees it


def test_every_claim_kind_has_a_mutation() -> None:
    covered = {rule for rule, *_ in CASES} | {rule for rule, *_ in ENGINE_CASES}
    missing = sorted(set(RULE_OF.values()) - covered)
    assert not missing, f"claim kinds with no mutation that makes them fail: {missing}"


def test_every_rule_family_has_a_negative_control() -> None:
    """A declared ``expect="fail"`` control in the installed plugins for every rule family,
    so ``kernelattn verify`` shows each family's checkers rejecting a real defect."""
    from kernelattn_core.verify import plan

    for module in ("kernelattn_maclaurin", "kernelattn_sampling", "kernelattn_hybrid", "kernelattn_spectral"):
        pytest.importorskip(module)
    declared = {c.rule[:2] for _, c in plan(registry=ka.Registry(autoload=True)) if c.expect == "fail"}
    families = {rule[:2] for rule in RULE_OF.values()}
    assert families <= declared, f"rule families with no declared negative control: {sorted(families - declared)}"


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_claim_passes_and_its_mutant_fails(reg: ka.Registry, case: Any) -> None:
    rule, name, select, mutate_class, mutate_claim = case
    entry = reg.get(name)
    claim = select(entry)
    assert claim.rule == rule
    good = check_claim(entry, claim, "quick")
    assert good.verdict == "pass", good
    bad_entry = mutate_class(entry) if mutate_class is not None else entry
    bad_claim = mutate_claim(claim) if mutate_claim is not None else claim
    bad = check_claim(bad_entry, bad_claim, "quick")
    assert bad.verdict == "fail", bad
    assert "error" not in bad.numbers, f"the mutant crashed the checker instead of failing it: {bad.numbers}"
