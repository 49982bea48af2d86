"""Property-based reliability fuzzing of every registered estimator, feature map and kernel.

Each property is checked with `hypothesis <https://hypothesis.readthedocs.io>`_ (a test
dependency, imported lazily) over random shapes, dtypes, input norms and corruption
patterns:

``causal_prefix_finite`` / ``causal_prefix_non_finite``
    With ``causal=True``, changing positions ``>= t`` (to other finite values, or to
    NaN / ``inf`` / ``-inf`` in ``q``, ``k`` or ``v``) leaves rows ``< t`` unchanged.
``padding_non_finite``
    Whatever a padded key or value holds (NaN, ``inf``, huge values), every row equals
    the output with other padded contents, with and without ``causal``.
``gradient_isolation``
    A NaN, ``inf`` or ``-inf`` at a future position (``causal=True``), at a padded key,
    or in a query row (its own row only), or later positions a hundred times larger:
    the rows that do not see it are finite, and so are the gradients of their loss for
    every other position and every trainable parameter (learned maps, normalisers); the
    offending position's own gradient is exactly 0, and with ``causal=True`` no later
    key or value gets any gradient from earlier rows.
``normalizer_causal``
    Every feature map with every registered normaliser (each ``stats`` choice
    included) either keeps causal prefix invariance or refuses ``causal=True`` with an
    :class:`~kernelattn_core.errors.InputError`, in training and eval mode.
``running_stats``
    A training batch whose keys are all padded (and hold NaN) leaves the module's eval
    outputs unchanged and finite (data-adapted maps must skip it).
``finite_at_norm``
    float32, float16 and bfloat16 inputs of scaled norm up to 10 give finite outputs and
    finite gradients, or a :class:`~kernelattn_core.errors.DomainError` naming the bound.
``empty_shapes``
    ``B = 0``, ``N = 0`` or ``M = 0`` give an empty output of shape ``[B, H, N, dv]``.
``replica_agreement``
    Two estimators built alike (the same ``seed``; or ``seed=None`` after the same
    ``torch.manual_seed``) give identical outputs over several training steps; every
    random estimator accepts ``seed``.
``bad_inputs``
    The catalogue :data:`BAD_INPUTS` (52 kinds): each is answered by an
    :class:`~kernelattn_core.errors.InputError` whose message names the argument.

A causal-only estimator (class data ``supports_noncausal = False``) is called with
``causal=True`` and ``N == M`` by every property.

A failure message starts with ``<name>: <property>:``. The CI profile (``kernelattn-ci``)
is derandomised, so a run is reproducible; set ``KERNELATTN_FUZZ_EXAMPLES`` to explore
more examples locally.

Plugins get the same suite with::

    from kernelattn_core.testing import fuzz_tests

    test_fuzz = fuzz_tests("myplugin")
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DomainError, InputError
from ..registry import Entry, Registry, get_registry

PROFILE = "kernelattn-ci"
NON_FINITE = (float("nan"), float("inf"), -float("inf"))
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _hypothesis() -> Any:
    try:
        import hypothesis
    except ImportError as exc:  # pragma: no cover - hypothesis is in the test extra
        raise ImportError("the kernelattn fuzz suite needs hypothesis (pip install 'kernelattn-core[test]')") from exc
    return hypothesis


def register_profile() -> None:
    """Register the derandomised CI profile ``kernelattn-ci`` (fixed examples, no
    database, no deadline) and load it unless another profile was chosen."""
    hyp = _hypothesis()
    settings, hc = hyp.settings, hyp.HealthCheck
    settings.register_profile(
        PROFILE,
        derandomize=True,
        database=None,
        deadline=None,
        max_examples=int(os.environ.get("KERNELATTN_FUZZ_EXAMPLES", "4")),
        print_blob=True,
        report_multiple_bugs=False,  # one failure per property, raised as is (names class and property)
        phases=(hyp.Phase.explicit, hyp.Phase.reuse, hyp.Phase.generate),  # no shrinking: bounded CI time
        suppress_health_check=[hc.too_slow, hc.data_too_large, hc.filter_too_much],
    )
    # hypothesis loads its own "ci" profile (100 random-order examples) when CI is set;
    # the suite's bound (~3 min) and fixed examples need this profile there too
    if settings._current_profile in (None, "default", "ci"):  # type: ignore[attr-defined]
        settings.load_profile(PROFILE)


@dataclass(frozen=True)
class FuzzCase:
    """One property of one registered name."""

    target: str
    prop: str
    run: Callable[[], None]

    @property
    def id(self) -> str:
        return f"{self.target}-{self.prop}"


class PropertyFailure(AssertionError):
    """A fuzz property failed; the message names the class and the property."""


# --------------------------------------------------------------------------- building
def _accepts(entry: Entry, option: str) -> bool:
    if entry.kind == "feature_map":
        return True  # wrapped in FeatureMapAttention, which takes seed, redraw_every, chunk_size
    if entry.kind == "kernel":
        return False
    params = inspect.signature(entry.cls.__init__).parameters
    return option in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _random(entry: Entry) -> bool:
    return entry.kind != "kernel" and bool(getattr(entry.cls, "random", False))


def make(entry: Entry, use_seed: int | None = 0, **extra: Any) -> Any:
    """The estimator of ``entry`` (through :func:`~kernelattn_core.create`) with a small
    budget and ``seed=use_seed`` when it takes one; ``extra`` options override."""
    from ..api import create

    opts: dict[str, Any] = {}
    if getattr(entry.cls, "has_budget", False) and entry.kind != "kernel":
        opts["num_features"] = 16
    if use_seed is not None and _random(entry) and _accepts(entry, "seed"):
        opts["seed"] = use_seed
    opts.update(extra)
    torch.manual_seed(0 if use_seed is None else use_seed)
    return create(entry.name, **opts)


def _base_call(hyp: Any, name: str, prop: str, est: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The unperturbed call of a property; an example whose head dimension the class
    refuses by design (FastFood needs a power of two) is rejected, any other error fails."""
    try:
        return est(*args, **kwargs)
    except InputError as exc:
        if "head_dim" in str(exc):
            hyp.reject()
        raise _fail(name, prop, f"unperturbed call raised InputError: {exc}") from exc
    except Exception as exc:
        raise _fail(name, prop, f"unperturbed call raised {type(exc).__name__}: {exc}") from exc


def _supports_causal(est: Any) -> bool:
    return bool(getattr(est, "supports_causal", True))


def _causal_only(obj: Any) -> bool:
    """Whether a class (or its instance) is causal only (``supports_noncausal = False``):
    every property then calls it with ``causal=True`` and ``N == M``."""
    return not bool(getattr(obj, "supports_noncausal", True))


def _tensors(seed: int, b: int, h: int, n: int, m: int, d: int, dv: int, norm: float, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """``q, k [.., d]`` whose rows have scaled norm ``norm`` (norm ``norm * d**0.25`` before
    the :math:`d^{-1/4}` scaling) and ``v [.., dv]``."""
    g = torch.Generator().manual_seed(seed)

    def rows(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12) * norm * d**0.25

    q, k = rows(b, h, n, d), rows(b, h, m, d)
    v = torch.randn(b, h, m, dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _fail(name: str, prop: str, message: str) -> PropertyFailure:
    return PropertyFailure(f"{name}: {prop}: {message}")


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return bool(torch.allclose(a.double(), b.double(), rtol=tol, atol=tol, equal_nan=True))


# --------------------------------------------------------------------------- properties
def _causal_prefix(entry: Entry, non_finite: bool) -> Callable[[], None]:
    hyp = _hypothesis()
    st = hyp.strategies
    prop = "causal_prefix_non_finite" if non_finite else "causal_prefix_finite"

    @hyp.settings(deadline=None)
    @hyp.given(
        seed=st.integers(0, 2**16),
        n=st.integers(2, 80),
        d=st.integers(1, 6),
        where=st.sampled_from(("q", "k", "v")),
        bad=st.sampled_from(NON_FINITE) if non_finite else st.sampled_from((3.0, 100.0)),
        data=st.data(),
    )
    def check(seed: int, n: int, d: int, where: str, bad: float, data: Any) -> None:
        t = data.draw(st.integers(1, n - 1), label="t")
        est = make(entry).double().eval()
        if not _supports_causal(est):
            return
        q, k, v = _tensors(seed, 1, 2, n, n, d, 3, 0.5, torch.float64)
        q[:, :, t:] = 0.0  # later rows see later keys through <q, k> = 0: inside every kernel's domain
        with torch.no_grad():
            base = _base_call(hyp, entry.name, prop, est, q, k, v, causal=True)
            x = {"q": q, "k": k, "v": v}[where].clone()
            if non_finite:
                x[:, :, t:] = bad
            else:
                # q stays small (later rows' own pairs in every kernel's domain); k and v may be large
                size = 0.05 if where == "q" else bad
                noise = torch.randn(x[:, :, t:].shape, generator=torch.Generator().manual_seed(seed + 1), dtype=x.dtype)
                x[:, :, t:] += size * noise
            args = {"q": q, "k": k, "v": v, where: x}
            try:
                out = est(args["q"], args["k"], args["v"], causal=True)
            except Exception as exc:
                raise _fail(
                    entry.name, prop, f"{where}[{t}:] = {bad} (later positions) raised {type(exc).__name__}: {exc}"
                ) from exc
        gap = (out[:, :, :t] - base[:, :, :t]).abs().nan_to_num(float("inf")).max()
        if not _close(out[:, :, :t], base[:, :, :t], 1e-7):
            raise _fail(entry.name, prop, f"{where}[{t}:] = {bad} changed rows < {t} (N = {n}) by {float(gap):.3g}")

    return check


def _padding(entry: Entry) -> Callable[[], None]:
    hyp = _hypothesis()
    st = hyp.strategies
    prop = "padding_non_finite"

    @hyp.settings(deadline=None)
    @hyp.given(
        seed=st.integers(0, 2**16),
        n=st.integers(1, 40),
        d=st.integers(1, 6),
        bad=st.sampled_from((*NON_FINITE, 1e4)),
        where=st.sampled_from(("k", "v", "kv")),
        causal=st.booleans(),
    )
    def check(seed: int, n: int, d: int, bad: float, where: str, causal: bool) -> None:
        est = make(entry).double().eval()
        causal = (causal and _supports_causal(est)) or _causal_only(est)
        m = n if causal else n + 3
        q, k, v = _tensors(seed, 2, 2, n, m, d, 3, 0.5, torch.float64)
        g = torch.Generator().manual_seed(seed + 7)
        mask = torch.rand(2, m, generator=g) < 0.4
        mask[:, 0] = False  # every sequence keeps a key
        pad = mask[:, None, :, None]
        with torch.no_grad():
            base = _base_call(hyp, entry.name, prop, est, q, k, v, causal=causal, key_padding_mask=mask)
            k2 = k.masked_fill(pad, bad) if "k" in where else k
            v2 = v.masked_fill(pad, bad) if "v" in where else v
            try:
                out = est(q, k2, v2, causal=causal, key_padding_mask=mask)
            except Exception as exc:
                raise _fail(
                    entry.name, prop, f"padded {where} = {bad} (causal={causal}) raised {type(exc).__name__}: {exc}"
                ) from exc
        if not bool(torch.isfinite(out).all()) and bool(torch.isfinite(base).all()):
            rows = int((~torch.isfinite(out)).any(-1).sum())
            raise _fail(entry.name, prop, f"padded {where} = {bad} (causal={causal}) made {rows} valid rows non-finite")
        if not _close(out, base, 1e-7):
            gap = float((out - base).abs().max())
            raise _fail(entry.name, prop, f"padded {where} = {bad} (causal={causal}) changed the output by {gap:.3g}")

    return check


def _gradient_isolation(entry: Entry) -> Callable[[], None]:
    hyp = _hypothesis()
    st = hyp.strategies
    prop = "gradient_isolation"

    @hyp.settings(deadline=None)
    @hyp.given(
        seed=st.integers(0, 2**16),
        n=st.integers(3, 40),
        d=st.integers(1, 6),
        mode=st.sampled_from(("future", "padded", "query_row")),
        where=st.sampled_from(("q", "k", "v")),
        bad=st.sampled_from((*NON_FINITE, "huge")),
        causal=st.booleans(),
        data=st.data(),
    )
    def check(seed: int, n: int, d: int, mode: str, where: str, bad: Any, causal: bool, data: Any) -> None:
        t = data.draw(st.integers(1, n - 1), label="t")
        est = make(entry).double().train()
        if mode == "future":  # the value is at position t, the loss reads rows < t only
            causal = True
            if not _supports_causal(est):
                return
        else:
            causal = (causal and _supports_causal(est)) or _causal_only(est)
        if mode == "padded":
            where = "k" if where == "q" else where  # a query is never padded
        if mode == "query_row":
            where = "q"  # a query row is seen by its own row only
        q, k, v = _tensors(seed, 1, 2, n, n, d, 3, 0.5, torch.float64)
        # later rows' own pairs well inside every kernel's domain (see causal_prefix), but not
        # 0: a map that normalises its input (rfa) has no gradient at 0
        q[:, :, t:] *= 0.1
        x = {"q": q, "k": k, "v": v}[where]
        if bad == "huge":  # finite, a hundred times larger than the others (features may overflow)
            at = slice(t, None) if mode == "future" else slice(t, t + 1)  # only what the loss does not see
            x[:, :, at] = 100.0 * (x[:, :, at] + (0.5 if where == "q" else 0.0))
            what = f"{where}[{t}{':' if mode == 'future' else ''}] x 100"
        else:
            x[:, :, t] = bad
            what = f"{where}[{t}] = {bad}"
        mask = None
        rows = torch.ones(n, dtype=torch.bool)
        if mode == "padded":
            mask = torch.zeros(1, n, dtype=torch.bool)
            mask[0, t] = True
            what = f"padded {what}"
        elif mode == "future":
            rows[t:] = False
        else:
            rows[t] = False
        mode_args = {"causal": causal, "key_padding_mask": mask}
        leaves = [a.requires_grad_() for a in (q, k, v)]
        params = [p for p in est.parameters() if p.requires_grad]
        try:
            est(*leaves, **mode_args)  # a first call builds lazily made parameters
            params = [p for p in est.parameters() if p.requires_grad]
            out = est(*leaves, **mode_args)
        except DomainError:
            return  # a documented bound (a value outside a kernel's domain)
        except InputError as exc:
            if "head_dim" in str(exc):  # a head dimension the class refuses by design
                hyp.reject()
            raise _fail(entry.name, prop, f"{what} ({mode}, causal={causal}) raised InputError: {exc}") from exc
        except Exception as exc:
            raise _fail(
                entry.name, prop, f"{what} ({mode}, causal={causal}) raised {type(exc).__name__}: {exc}"
            ) from exc
        if not _finite(out[:, :, rows]):
            raise _fail(entry.name, prop, f"{what} ({mode}, causal={causal}): rows that do not see it are non-finite")
        grads = torch.autograd.grad(out[:, :, rows].sum(), [*leaves, *params], allow_unused=True)
        own = torch.zeros(n, dtype=torch.bool)
        own[t if bad != "huge" or mode != "future" else slice(t, None)] = True
        for arg, g in zip("qkv", grads[:3]):
            if g is None:
                continue
            if not _finite(g[:, :, ~own]):
                raise _fail(entry.name, prop, f"{what} ({mode}, causal={causal}): non-finite {arg}.grad elsewhere")
            own_ok = _finite(g[:, :, own]) if bad == "huge" else bool((g[:, :, own] == 0).all())
            if arg == where and not own_ok:
                raise _fail(
                    entry.name, prop, f"{what} ({mode}, causal={causal}): {arg}.grad at its own position is not 0"
                )
            if mode == "future" and arg in "kv" and bool((g[:, :, t:] != 0).any()):
                raise _fail(entry.name, prop, f"{what} (future): rows < {t} have a {arg}.grad at positions >= {t}")
        for (name, _), g in zip(
            [(n_, p_) for n_, p_ in est.named_parameters() if p_.requires_grad], grads[3:], strict=False
        ):
            if g is not None and not _finite(g):
                raise _fail(entry.name, prop, f"{what} ({mode}, causal={causal}): non-finite gradient of {name}")

    return check


def _running_stats(entry: Entry) -> Callable[[], None]:
    prop = "running_stats"

    def check() -> None:
        q, k, v = _tensors(3, 2, 2, 6, 6, 4, 3, 0.5, torch.float32)
        est, twin = make(entry).train(), make(entry).train()
        mode = {"causal": True} if _causal_only(est) else {}
        mask = torch.ones(2, 6, dtype=torch.bool)
        with torch.no_grad():
            for module in (est, twin):  # both see one ordinary training batch
                module(q, k, v, **mode)
            try:
                est(q, k.masked_fill(mask[:, None, :, None], float("nan")), v, key_padding_mask=mask, **mode)
            except InputError:
                pass  # refusing an all-padded batch with a clear error is allowed
            except Exception as exc:
                raise _fail(
                    entry.name, prop, f"an all-padded training batch raised {type(exc).__name__}: {exc}"
                ) from exc
            est.eval()
            twin.eval()
            out, ref = est(q, k, v, **mode), twin(q, k, v, **mode)
        if not bool(torch.isfinite(out).all()):
            raise _fail(entry.name, prop, "after one all-padded (NaN) training batch, eval outputs are non-finite")
        # estimators that draw afresh on every training call (sampling) legitimately differ
        # after an extra training call; feature maps redraw only on schedule (never here)
        redraws_each_call = entry.kind == "estimator" and _random(entry) and not _accepts(entry, "redraw_every")
        if not redraws_each_call and not _close(out, ref, 1e-5):
            raise _fail(entry.name, prop, "an all-padded training batch changed the running statistics")

    return check


def _finite_at_norm(entry: Entry) -> Callable[[], None]:
    hyp = _hypothesis()
    st = hyp.strategies
    prop = "finite_at_norm"

    @hyp.settings(deadline=None)
    @hyp.given(
        seed=st.integers(0, 2**16),
        n=st.integers(1, 24),
        d=st.integers(1, 8),
        norm=st.sampled_from((0.5, 3.0, 10.0)) | st.floats(0.1, 10.0),
        dtype=st.sampled_from(DTYPES),
        causal=st.booleans(),
    )
    def check(seed: int, n: int, d: int, norm: float, dtype: torch.dtype, causal: bool) -> None:
        est = make(entry).eval()
        causal = (causal and _supports_causal(est)) or _causal_only(est)
        q, k, v = _tensors(seed, 1, 2, n, n, d, 3, norm, dtype)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        what = f"{str(dtype).replace('torch.', '')}, scaled norm {norm:.3g}, d = {d}, causal={causal}"
        try:
            out = est(q, k, v, causal=causal)
        except DomainError:
            return  # a documented bound (the message names it; checked by the kernels' own tests)
        except InputError as exc:
            if "head_dim" in str(exc):  # a head dimension the class refuses by design
                hyp.reject()
            raise _fail(entry.name, prop, f"{what}: raised InputError: {exc}") from exc
        except Exception as exc:
            raise _fail(entry.name, prop, f"{what}: raised {type(exc).__name__}: {exc}") from exc
        if not bool(torch.isfinite(out).all()):
            raise _fail(entry.name, prop, f"{what}: non-finite output")
        out.float().square().mean().backward()
        bad = [arg for arg, t in (("q", q), ("k", k), ("v", v)) if t.grad is not None and not _finite(t.grad)]
        if bad and dtype == torch.float16:
            _beyond_range(est, entry.name, prop, what, (q, k, v), causal, bad)
        elif bad:
            raise _fail(entry.name, prop, f"{what}: non-finite {bad[0]}.grad")

    return check


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _beyond_range(est: Any, name: str, prop: str, what: str, qkv: tuple, causal: bool, bad: list[str]) -> None:
    """A float16 gradient that is not finite passes only when the same call in float32
    (the same float16 inputs, widened) gives a finite gradient within a factor of 8 of
    float16's maximum or beyond it: the exact gradient itself is then not representable
    (a signed estimator whose denominator nears zero), not an overflow inside the
    computation. The factor: the half call also rounds the scaled ``q``, ``k`` to
    float16 (relative 2^-11), and near a zero denominator that moves the output and its
    gradient by whole factors (seen: ``trig-softmax-features`` output 204 in float16
    against 61 in float32, float32 gradient 3.2e4), so a float32 gradient of that size
    cannot certify that the half one is representable. A gradient far inside the range
    (the control ``ctl-half-grad-overflow``: about 1) still fails."""
    wide = [t.detach().float().requires_grad_() for t in qkv]
    est(*wide, causal=causal).square().mean().backward()
    top = torch.finfo(torch.float16).max
    for arg in bad:
        g = dict(zip("qkv", wide, strict=True))[arg].grad
        if g is None or not _finite(g) or float(g.abs().max()) < top / 8:
            largest = "non-finite" if g is None or not _finite(g) else f"{float(g.abs().max()):.3g}"
            raise _fail(
                name, prop, f"{what}: non-finite {arg}.grad in float16 although the float32 gradient is {largest}"
            )


def _empty_shapes(entry: Entry) -> Callable[[], None]:
    prop = "empty_shapes"

    def check() -> None:
        est = make(entry).eval()
        shapes = ((0, 3, 3, False), (2, 0, 3, False), (2, 3, 0, False), (2, 0, 0, True))
        if _causal_only(est):  # N == M, causal: the empty batch and the empty sequence
            shapes = ((0, 3, 3, True), (2, 0, 0, True))
        for b, n, m, causal in shapes:
            if causal and not _supports_causal(est):
                continue
            q = torch.randn(b, 2, n, 4, requires_grad=True)
            k = torch.randn(b, 2, m, 4, requires_grad=True)
            v = torch.randn(b, 2, m, 3, requires_grad=True)
            try:
                out = est(q, k, v, causal=causal)
                out.sum().backward()
            except Exception as exc:
                raise _fail(entry.name, prop, f"B={b}, N={n}, M={m}: raised {type(exc).__name__}: {exc}") from exc
            if tuple(out.shape) != (b, 2, n, 3):
                raise _fail(entry.name, prop, f"B={b}, N={n}, M={m}: shape {tuple(out.shape)}, not {(b, 2, n, 3)}")

    return check


def _replica_agreement(entry: Entry) -> Callable[[], None]:
    prop = "replica_agreement"

    def check() -> None:
        if not _random(entry):
            return
        if not _accepts(entry, "seed"):
            raise _fail(entry.name, prop, "a random estimator must take a seed option")
        extra = {"redraw_every": 1} if _accepts(entry, "redraw_every") else {}
        q, k, v = _tensors(5, 1, 2, 7, 7, 4, 3, 0.5, torch.float32)
        for seed in (11, None):
            torch.manual_seed(3)
            a = make(entry, use_seed=seed, **extra).train()
            torch.manual_seed(3)
            b = make(entry, use_seed=seed, **extra).train()
            mode = {"causal": True} if _causal_only(a) else {}
            for step in range(3):
                torch.manual_seed(100 + step)  # the global generator moves between replicas' steps
                out_a = a(q, k, v, **mode)
                torch.manual_seed(200 + step)
                out_b = b(q, k, v, **mode)
                if not torch.equal(out_a, out_b):
                    gap = float((out_a - out_b).abs().max())
                    raise _fail(entry.name, prop, f"seed={seed}: replicas differ by {gap:.3g} at training step {step}")

    return check


def _normalizer_variants(registry: Registry) -> list[tuple[str, Any]]:
    """Every registered normaliser with default options, plus each ``stats`` choice of
    those that take one (batch statistics are where causal leaks hide)."""
    out = []
    for entry in registry.entries("normalizer"):
        out.append((entry.name, {}))
        params = inspect.signature(entry.cls.__init__).parameters
        if "stats" in params:
            out += [(entry.name, {"stats": choice}) for choice in ("batch", "token", "running")]
    return out


def _normalizer_causal(entry: Entry) -> Callable[[], None]:
    prop = "normalizer_causal"

    def check() -> None:
        if entry.kind != "feature_map":
            return
        from ..builtins.estimators import FeatureMapAttention

        registry = get_registry()
        q, k, v = _tensors(21, 2, 2, 12, 12, 4, 3, 0.5, torch.float64)
        t = 5
        k2, v2 = k.clone(), v.clone()
        k2[:, :, t:] += 3.0 * torch.randn(k2[:, :, t:].shape, generator=torch.Generator().manual_seed(1), dtype=k.dtype)
        v2[:, :, t:] -= 5.0
        problems = []
        for norm_name, options in _normalizer_variants(registry):
            label = f"{norm_name}({', '.join(f'{a}={b!r}' for a, b in options.items())})"
            try:
                norm = registry.normalizer(norm_name)(**options)
            except InputError:
                continue  # a choice this normaliser does not have

            def fresh(training: bool, norm: Any = norm) -> Any:
                # a fresh twin per call: a training call may update statistics for *later* calls
                torch.manual_seed(0)
                return (
                    FeatureMapAttention(entry.name, copy.deepcopy(norm), num_features=16, seed=0)
                    .double()
                    .train(training)
                )

            for training in (False, True):
                try:
                    with torch.no_grad():
                        base = fresh(training)(q, k, v, causal=True)
                        out = fresh(training)(q, k2, v2, causal=True)
                except InputError:
                    continue  # refusing causal mode with a clear error is allowed
                except Exception as exc:
                    problems.append(f"{label}, training={training}: raised {type(exc).__name__}: {exc}")
                    continue
                if not _close(out[:, :, :t], base[:, :, :t], 1e-7):
                    gap = float((out[:, :, :t] - base[:, :, :t]).abs().nan_to_num(float("inf")).max())
                    problems.append(f"{label}, training={training}: later tokens changed earlier rows by {gap:.3g}")
        if problems:
            raise _fail(entry.name, prop, "normaliser leaks the future:\n" + "\n".join(problems))

    return check


# --------------------------------------------------------------------------- the bad-input catalogue
def _qkv(b: int = 2, h: int = 2, n: int = 5, m: int = 5, d: int = 4, dv: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(b, h, n, d, generator=g) * 0.3,
        torch.randn(b, h, m, d, generator=g) * 0.3,
        torch.randn(b, h, m, dv, generator=g),
    ]


def _call(**change: Any) -> Callable[[Any], Any]:
    """A call of a built estimator with some arguments replaced (``causal=True`` for a
    causal-only estimator unless the change sets ``causal``)."""

    def run(est: Any) -> Any:
        q, k, v = _qkv()
        args: dict[str, Any] = {"q": q, "k": k, "v": v}
        kwargs: dict[str, Any] = {"causal": True} if _causal_only(est) else {}
        for key, value in change.items():
            value = value(q, k, v) if callable(value) else value
            (args if key in ("q", "k", "v") else kwargs)[key] = value
        return est(args["q"], args["k"], args["v"], **kwargs)

    return run


@dataclass(frozen=True)
class BadInput:
    """One kind of bad input: what is passed, and the argument the error must name."""

    kind: str
    argument: str
    options: dict[str, Any] | None = None  # bad construction options (None: a good construction)
    call: Callable[[Any], Any] | None = None  # a bad call of a well-built estimator
    needs: str = ""  # "budget", "random", "feature_map": only classes with that capability
    may_work: bool = False  # a class may also handle it correctly (then it is no bad input for it)
    #: a bad use of the class through KernelAttention or its state (given the entry)
    module_call: Callable[[Entry], Any] | None = None


def _meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty(q.shape, device="meta")


def _twice(est: Any) -> Any:
    mode = {"causal": True} if _causal_only(est) else {}
    q, k, v = _qkv(d=4)
    est(q, k, v, **mode)
    q, k, v = _qkv(d=6)
    return est(q, k, v, **mode)


def _module(entry: Entry, **options: Any) -> Any:
    """:class:`~kernelattn_core.KernelAttention` (width 8, 2 heads) around ``entry``'s class."""
    from ..module import KernelAttention

    opts: dict[str, Any] = {}
    if getattr(entry.cls, "has_budget", False) and entry.kind != "kernel":
        opts["num_features"] = 16
    if _random(entry) and _accepts(entry, "seed"):
        opts["seed"] = 0
    if _causal_only(entry.cls):
        opts["causal"] = True
    torch.manual_seed(0)
    return KernelAttention(8, 2, estimator=entry.name, **{"batch_first": True, **opts, **options})


def _x(batch: int = 2, n: int = 3) -> torch.Tensor:
    return 0.1 * torch.randn(batch, n, 8, generator=torch.Generator().manual_seed(2))


def _is_causal(value: object) -> Callable[[Entry], Any]:
    return lambda entry: _module(entry)(_x(), is_causal=value)


def _foreign_state(kind: str) -> Callable[[Entry], Any]:
    def run(entry: Entry) -> Any:
        module = _module(entry)
        if not _supports_causal(module.estimator):
            return None  # no decoding: nothing to refuse
        state: Any = {"kv": 1}
        if kind == "batch":  # a batch-1 state given to a batch of 2
            state = module.step(_x(batch=1))[1]
        return module.step(_x(n=1), state)

    return run


def _families(module: Any) -> dict[str, bytes]:
    return {k: bytes(v.tolist()) for k, v in module.state_dict().items() if k.endswith("_family")}


def _other_family(entry: Entry) -> Any:
    """``load_state_dict`` of another family's checkpoint (``elu``'s, or ``softmax``'s for
    ``elu`` itself)."""
    from ..api import create

    est = make(entry)
    est(*_qkv(), **({"causal": True} if _causal_only(est) else {}))  # builds what is built lazily
    other = create("elu")
    if _families(other) == _families(est):
        other = create("softmax")
    return est.load_state_dict(other.state_dict())


#: 52 kinds of bad input; each must raise InputError naming ``argument``.
BAD_INPUTS: tuple[BadInput, ...] = (
    BadInput("scale-nan", "scale", {"scale": float("nan")}),
    BadInput("scale-inf", "scale", {"scale": float("inf")}),
    BadInput("scale-negative", "scale", {"scale": -1.0}),
    BadInput("scale-zero", "scale", {"scale": 0.0}),
    BadInput("scale-string", "scale", {"scale": "1"}),
    BadInput("scale-bool", "scale", {"scale": True}),
    BadInput("num-features-zero", "num_features", {"num_features": 0}, needs="budget"),
    BadInput("num-features-negative", "num_features", {"num_features": -3}, needs="budget"),
    BadInput("num-features-float", "num_features", {"num_features": 2.5}, needs="budget"),
    BadInput("num-features-bool", "num_features", {"num_features": True}, needs="budget"),
    BadInput("num-features-huge", "num_features", {"num_features": 10**9}, needs="budget"),
    BadInput("unknown-option", "definitely_not_an_option", {"definitely_not_an_option": 1}),
    BadInput("seed-string", "seed", {"seed": "0"}, needs="random"),
    BadInput("seed-float", "seed", {"seed": 0.5}, needs="random"),
    BadInput("redraw-every-negative", "redraw_every", {"redraw_every": -1}, needs="feature_map"),
    BadInput("chunk-size-zero", "chunk_size", {"chunk_size": 0}, needs="feature_map"),
    BadInput("q-not-a-tensor", "q", call=_call(q=lambda q, k, v: q.tolist())),
    BadInput("k-not-a-tensor", "k", call=_call(k=lambda q, k, v: k.tolist())),
    BadInput("v-not-a-tensor", "v", call=_call(v=lambda q, k, v: v.numpy())),
    BadInput("q-integer-dtype", "q", call=_call(q=lambda q, k, v: q.long())),
    BadInput("q-bool-dtype", "q", call=_call(q=lambda q, k, v: q > 0)),
    BadInput("q-complex-dtype", "q", call=_call(q=lambda q, k, v: q.to(torch.complex64))),
    BadInput("v-integer-dtype", "v", call=_call(v=lambda q, k, v: v.int())),
    BadInput("q-3d", "q", call=_call(q=lambda q, k, v: q[0])),
    BadInput("q-scalar", "q", call=_call(q=lambda q, k, v: q.sum())),
    BadInput("k-5d", "k", call=_call(k=lambda q, k, v: k[None])),
    BadInput("v-2d", "v", call=_call(v=lambda q, k, v: v[0, 0])),
    BadInput("k-dtype-differs", "k", call=_call(k=lambda q, k, v: k.double())),
    BadInput("v-dtype-differs", "v", call=_call(v=lambda q, k, v: v.half())),
    BadInput("k-head-dim-differs", "k", call=_call(k=lambda q, k, v: k[..., :3])),
    BadInput("k-batch-differs", "k", call=_call(k=lambda q, k, v: k[:1])),
    BadInput("k-heads-differ", "k", call=_call(k=lambda q, k, v: k[:, :1])),
    BadInput("v-length-differs", "v", call=_call(v=lambda q, k, v: v[:, :, :3])),
    BadInput("head-dim-zero", "q", call=_call(q=lambda q, k, v: q[..., :0], k=lambda q, k, v: k[..., :0])),
    BadInput("causal-string", "causal", call=_call(causal="yes")),
    BadInput("causal-int", "causal", call=_call(causal=1)),
    BadInput(
        "causal-n-differs-from-m",
        "causal",
        call=_call(causal=True, k=lambda q, k, v: k[:, :, :3], v=lambda q, k, v: v[:, :, :3]),
    ),
    BadInput("mask-float", "key_padding_mask", call=_call(key_padding_mask=torch.zeros(2, 5))),
    BadInput("mask-int", "key_padding_mask", call=_call(key_padding_mask=torch.zeros(2, 5, dtype=torch.long))),
    BadInput("mask-wrong-shape", "key_padding_mask", call=_call(key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))),
    BadInput("mask-1d", "key_padding_mask", call=_call(key_padding_mask=torch.zeros(5, dtype=torch.bool))),
    BadInput("mask-list", "key_padding_mask", call=_call(key_padding_mask=[[False] * 5] * 2)),
    BadInput("mask-wrong-batch", "key_padding_mask", call=_call(key_padding_mask=torch.zeros(3, 5, dtype=torch.bool))),
    BadInput("q-meta-device", "q", call=_call(q=_meta, k=_meta, v=_meta)),
    # a class with d-dependent state (a built map) must refuse a new d; others may just work
    BadInput("head-dim-changes-after-build", "d", call=_twice, may_work=True),
    # through KernelAttention: flags are bools, never read by their truth value ("no" is not True)
    BadInput("is-causal-string", "is_causal", module_call=_is_causal("no")),
    BadInput("is-causal-int", "is_causal", module_call=_is_causal(1)),
    BadInput("module-causal-string", "causal", module_call=lambda entry: _module(entry, causal="yes")),
    BadInput("module-batch-first-string", "batch_first", module_call=lambda entry: _module(entry, batch_first="no")),
    # decoding states know their owner; checkpoints their family
    BadInput("step-state-not-a-state", "state", module_call=_foreign_state("dict")),
    BadInput("step-state-of-another-batch", "state", module_call=_foreign_state("batch")),
    BadInput("load-state-dict-of-another-family", "state_dict", module_call=_other_family),
)


def _applies(bad: BadInput, entry: Entry) -> bool:
    if bad.needs == "budget":
        return bool(getattr(entry.cls, "has_budget", False)) and entry.kind != "kernel"
    if bad.needs == "random":
        return _random(entry)
    if bad.needs == "feature_map":
        return entry.kind == "feature_map"
    return True


def _names_argument(message: str, argument: str) -> bool:
    if argument == "d":  # a changed head dimension: the message must say which one
        return any(w in message for w in ("head_dim", "d = ", "last dimension", "head dimension"))
    return argument in message


def check_bad_input(entry: Entry, bad: BadInput) -> str | None:
    """``None`` when ``bad`` is answered by an InputError naming its argument, else what
    happened instead (``silent``: no error; ``obscure``: another error or a message
    that does not name the argument)."""
    try:
        if bad.module_call is not None:
            with torch.no_grad():
                out = bad.module_call(entry)
            if out is None:  # the class has nothing this kind could misuse
                return None
            return f"silent: accepted (expected an InputError naming {bad.argument!r})"
        if bad.options is not None:
            est = make(entry, **bad.options)
            if bad.call is None:
                q, k, v = _qkv()
                est(q, k, v, **({"causal": True} if _causal_only(est) else {}))  # an option may be checked on first use
        else:
            est = make(entry).eval()
        if bad.call is not None:
            with torch.no_grad():
                out = bad.call(est)
            if bad.may_work and isinstance(out, torch.Tensor) and bool(torch.isfinite(out).all()):
                return None
    except InputError as exc:
        if _names_argument(str(exc), bad.argument):
            return None
        return f"obscure: InputError does not name {bad.argument!r}: {exc}"
    except Exception as exc:
        return f"obscure: {type(exc).__name__} instead of InputError naming {bad.argument!r}: {exc}"
    return f"silent: accepted (expected an InputError naming {bad.argument!r})"


def _bad_inputs(entry: Entry) -> Callable[[], None]:
    def check() -> None:
        problems = [
            f"{bad.kind}: {why}"
            for bad in BAD_INPUTS
            if _applies(bad, entry) and (why := check_bad_input(entry, bad)) is not None
        ]
        if problems:
            raise _fail(
                entry.name, "bad_inputs", f"{len(problems)} kinds not answered clearly:\n" + "\n".join(problems)
            )

    return check


# --------------------------------------------------------------------------- collection
PROPERTIES: dict[str, Callable[[Entry], Callable[[], None]]] = {
    "causal_prefix_finite": lambda e: _causal_prefix(e, non_finite=False),
    "causal_prefix_non_finite": lambda e: _causal_prefix(e, non_finite=True),
    "padding_non_finite": _padding,
    "gradient_isolation": _gradient_isolation,
    "running_stats": _running_stats,
    "normalizer_causal": _normalizer_causal,
    "finite_at_norm": _finite_at_norm,
    "empty_shapes": _empty_shapes,
    "replica_agreement": _replica_agreement,
    "bad_inputs": _bad_inputs,
}


def attention_entries(*names: str, registry: Registry | None = None) -> list[Entry]:
    """Every registered estimator, feature map and kernel (the names :func:`~kernelattn_core.create`
    builds), or those of the given plugins / class names."""
    registry = registry or get_registry()
    if names:
        from ..verify import select

        entries = select(list(names), registry)
    else:
        entries = registry.entries()
    return [e for e in entries if e.kind in ("estimator", "feature_map", "kernel")]


def fuzz_cases(*names: str, registry: Registry | None = None, properties: tuple[str, ...] = ()) -> list[FuzzCase]:
    """One case per (name, property); ``properties`` restricts to some of :data:`PROPERTIES`."""
    chosen = properties or tuple(PROPERTIES)
    return [FuzzCase(e.name, p, _deferred(e, p)) for e in attention_entries(*names, registry=registry) for p in chosen]


def _deferred(entry: Entry, prop: str) -> Callable[[], None]:
    def run() -> None:
        register_profile()
        PROPERTIES[prop](entry)()

    return run


def fuzz_tests(*names: str, properties: tuple[str, ...] = ()) -> Callable[..., None]:
    """A pytest test function parametrised over :func:`fuzz_cases` (the conformance-kit
    hook: ``test_fuzz = fuzz_tests("myplugin")`` in a plugin's tests)."""
    import pytest

    cases = fuzz_cases(*names, properties=properties)

    @pytest.mark.parametrize("case", cases, ids=[c.id for c in cases])
    def test_fuzz(case: FuzzCase) -> None:
        case.run()

    return test_fuzz


__all__ = ["BAD_INPUTS", "PROFILE", "PROPERTIES", "BadInput", "FuzzCase", "fuzz_cases", "fuzz_tests", "make"]
