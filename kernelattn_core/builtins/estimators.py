"""Estimators built into the core: exact attention (the reference) and
feature-map attention (linear in sequence length)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ..engine.backends import (
    Backend,
    Problem,
    attend_normalized,
    attend_step,
    preferred_backend,
    select_backend,
)
from ..engine.chunked import CausalState, compute_dtype
from ..engine.naive import (
    allowed_pairs,
    isolated_pre,
    isolated_rows,
    poison_rows,
    quarantine_non_finite,
    quarantine_overflow,
    quarantine_traced,
)
from ..engine.torch_backend import decode_one_finite
from ..errors import InputError
from ..interfaces.estimator import AttentionEstimator
from ..interfaces.feature_map import FeatureMap, prepare_takes_scale
from ..interfaces.kernel import Kernel
from ..interfaces.names import construct, resolve_class
from ..interfaces.normalizer import Normalizer, takes_causal
from ..interfaces.state import StateOwner, check_state, check_state_tensor, continued_sums
from ..redraw import RedrawPolicy
from ..validation import all_finite, check_positive_int, check_seed, masks_nothing
from .kernels import SoftmaxKernel

#: kept for plugins written before the toolkit (``from kernelattn_core.builtins.estimators import _construct``)
_construct = construct


def resolve_kernel(kernel: Kernel | type[Kernel] | str, options: dict[str, Any]) -> Kernel:
    """A kernel instance from an instance, a class (built with ``options``) or, for
    callers below :func:`~kernelattn_core.create`, a registry name."""
    if isinstance(kernel, Kernel):
        if options:
            raise InputError(f"kernel: options {sorted(options)} given with a Kernel instance; pass a name instead")
        return kernel
    if isinstance(kernel, type) and issubclass(kernel, Kernel):
        return construct("kernel", kernel, "kernel", options)
    if not isinstance(kernel, str):
        raise InputError(
            f"kernel: expected a Kernel, a Kernel subclass or a registry name, got {type(kernel).__name__}"
        )
    return construct("kernel", resolve_class(kernel, "kernel"), "kernel", options)


def _weighted_values(w: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """:math:`\\sum_{j \\text{ allowed}} w_{ij} v_j`, ``[B, H, N, dv]``, for weights ``w [B, H, N, M]``
    that are 0 outside ``allowed`` and values ``v [B, H, M, dv]``.

    ``w @ v`` would give :math:`0 \\cdot \\mathrm{NaN} = \\mathrm{NaN}` in a row that must not see a
    non-finite ``v_j`` (a later position under the causal mask). Non-finite values are
    therefore replaced by 0 in the product, and an output entry is set to NaN exactly
    where an *allowed* key carries a non-finite value in that column.
    """
    finite = torch.isfinite(v)
    if allowed is None or bool(finite.all()):
        return w @ v
    out = w @ torch.where(finite, v, torch.zeros_like(v))
    seen = (allowed.to(v.dtype) @ (~finite).to(v.dtype)) > 0  # [B, H, N, dv]: a non-finite value is visible
    return out.masked_fill(seen, float("nan"))


class ExactAttention(AttentionEstimator):
    """Exact kernelized attention (quadratic; the reference every estimator is
    compared with).

    .. math:: \\mathrm{out}_i = \\frac{\\sum_{j} K(q_i, k_j) v_j}{\\sum_{j} K(q_i, k_j)}

    over the allowed keys ``j`` (causal and padding masks), on inputs scaled by
    :math:`d^{-1/4}`; a query with no allowed key gets zeros.

    Two paths, tested against each other on outputs and gradients:

    * ``"naive"`` — the readable reference: weights formed in log space when the
      kernel gives :math:`\\log K` (row maximum over the allowed keys only, so causal
      rows never see later keys), else from the kernel matrix;
    * ``"sdpa"`` — for the softmax kernel, torch's fused
      ``scaled_dot_product_attention`` with the same masks (rows with no allowed key
      are given a harmless mask and zeroed afterwards, so neither outputs nor
      gradients see NaN). ``"auto"`` (the default) takes it when it applies.

    Parameters
    ----------
    kernel : Kernel, Kernel subclass or str
        The kernel, its class (built with ``**kernel_options``) or its registry name
        (resolved by the registry; :func:`~kernelattn_core.create` passes the class);
        ``"softmax"`` by default.
    scale : float, optional
        See :class:`~kernelattn_core.interfaces.AttentionEstimator`.
    backend : {"auto", "sdpa", "naive"}
        Which path computes softmax attention.
    seed : int, optional
        Accepted and unused (exact attention draws nothing), as the estimators without
        random features accept it: a loop that gives every estimator one seed includes
        the reference.
    **kernel_options
        Passed to the kernel class when ``kernel`` is a class or a name.
    """

    name: ClassVar[str] = "exact"
    unbiased: ClassVar[bool] = True
    consistent: ClassVar[bool] = True

    def __init__(
        self,
        kernel: Kernel | type[Kernel] | str = "softmax",
        *,
        scale: float | None = None,
        backend: str = "auto",
        seed: int | None = None,
        **kernel_options: Any,
    ) -> None:
        super().__init__(scale=scale)
        check_seed("seed", seed)  # any int, as the random estimators take
        self.kernel = resolve_kernel(kernel, kernel_options)
        if backend not in ("auto", "sdpa", "naive"):
            raise InputError(f"backend: expected 'auto', 'sdpa' or 'naive', got {backend!r}")
        is_softmax = type(self.kernel).log_evaluate is SoftmaxKernel.log_evaluate
        if backend == "sdpa" and not is_softmax:
            raise InputError(f"backend: 'sdpa' computes softmax attention only, got kernel {self.kernel.name!r}")
        self.backend = "sdpa" if backend in ("auto", "sdpa") and is_softmax else "naive"

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        dtype = compute_dtype(q.dtype)
        q, k, v32 = q.to(dtype), k.to(dtype), v.to(dtype)
        if key_padding_mask is not None:
            # a padded key or value is seen by no query: replace it (never multiply it by 0)
            pad = key_padding_mask[:, None, :, None]  # [B, 1, M, 1]
            k = k.masked_fill(pad, 0.0)
            v32 = v32.masked_fill(pad, 0.0)
        # SDPA forms q k^T + mask and weights @ v: a non-finite later key or value would
        # reach earlier causal rows (NaN + -inf, 0 * NaN), a non-finite query row the keys'
        # gradients of every row, and a non-finite key its own gradient (NaN, not 0); such
        # calls take the reference path, which quarantines them
        if self.backend == "sdpa" and torch.compiler.is_compiling():
            # traced (one graph, no value read back): the quarantine as tensor operations,
            # always; for finite inputs its masks change nothing (padded keys are 0 by now)
            q, k, v32, poison = quarantine_traced(q, k, v32, causal)
            self.last_backend = "sdpa"
            return poison_rows(self._sdpa(q, k, v32, causal, key_padding_mask), poison).to(v.dtype)
        if self.backend == "sdpa" and all_finite(q, k, v32):
            self.last_backend = "sdpa"
            return self._sdpa(q, k, v32, causal, key_padding_mask).to(v.dtype)
        self.last_backend = "naive"
        allowed = allowed_pairs(q.shape[-2], k.shape[-2], causal, key_padding_mask, q.device)  # [B|1, 1, N, M]
        q, k, v32, poison = quarantine_non_finite(q, k, v32, allowed)
        logits = self.kernel.log_evaluate(q, k)  # [B, H, N, M] or None
        if logits is not None:
            quarantined = quarantine_overflow(logits.detach(), q, k, v32, allowed, poison)
            if quarantined is not None:  # a finite input whose kernel values overflow
                q, k, v32, poison = quarantined
                logits = self.kernel.log_evaluate(q, k)
        if logits is None:
            w = self.kernel.row_scaled_matrix(q, k, allowed)  # [B, H, N, M], 0 outside allowed
            den = w.sum(-1, keepdim=True)
        else:
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
            top = logits.detach().amax(-1, keepdim=True)  # over allowed keys of the row only
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
            w = (logits - top).exp()
            den = w.sum(-1, keepdim=True)
        # a row whose kernel values overflow (a finite but huge key: (1 + q.k)^p, or Matern's
        # (1 + z) e^-z at z = inf) is NaN, as a row that sees a non-finite input is; it sends
        # no gradient back, where the backward of its normalisation would be 0 * inf for every
        # key it sees, earlier ones included (tensor operations only: nothing read back)
        overflow = ~torch.isfinite(den)  # [B, H, N, 1]
        w, den = w.masked_fill(overflow, 0.0), den.masked_fill(overflow, 0.0)
        poison = overflow.squeeze(-1) if poison is None else poison | overflow.squeeze(-1)
        out = _weighted_values(w, v32, allowed) / torch.where(den == 0, torch.ones_like(den), den)
        return poison_rows(out, poison).to(v.dtype)

    @staticmethod
    def _sdpa(q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        if key_padding_mask is None:  # q, k already carry the scale: scale=1
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0)
        allowed = allowed_pairs(q.shape[-2], k.shape[-2], causal, key_padding_mask, q.device)  # [B, 1, N, M]
        some = allowed.any(-1, keepdim=True)  # [B, 1, N, 1]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~some, scale=1.0)
        return torch.where(some, out, torch.zeros_like(out))

    def state_family(self) -> str:
        """``exact(<kernel>)``: exact attention of another kernel is another family."""
        return f"exact({getattr(self.kernel, 'name', type(self.kernel).__name__)})"

    def extra_repr(self) -> str:
        return f"kernel={self.kernel!r}, scale={self.scale}"


class FeatureMapAttention(AttentionEstimator):
    """Kernelized attention through a feature map, linear in sequence length.

    .. math::
        \\mathrm{out}_i = \\mathrm{post}\\left(
        \\frac{\\phi_q(q_i)^\\top \\sum_j \\phi_k(k_j) v_j^\\top}{\\phi_q(q_i)^\\top \\sum_j \\phi_k(k_j)}
        \\right), \\qquad (q, k) \\leftarrow \\mathrm{pre}(q, k)

    The ratio is self-normalised: even when :math:`\\phi_q^\\top \\phi_k` is unbiased
    for the kernel, the output is biased at finite ``num_features`` and consistent as
    it grows.

    Parameters
    ----------
    feature_map : FeatureMap, FeatureMap subclass or str
        The map, or its class or registry name (then ``num_features`` and
        ``**feature_map_options`` build it). :func:`~kernelattn_core.create` passes the
        class it resolved; a name given here is resolved by the registry.
    normalizer : Normalizer, Normalizer subclass or str, optional
        The map's ``default_normalizer`` (``"row"``, plain row normalisation, unless the
        map names another) when ``None``.
    num_features : int, optional
        The feature budget :math:`D` (the map's default when ``None``).
    head_dim : int, optional
        Build the map now; otherwise on the first call.
    redraw_every : int
        Redraw the random features every this many training forward calls (0: never);
        frozen in eval mode. A call in training mode under ``torch.no_grad()`` counts; the
        recompute of an activation checkpoint does not (it reuses the draw of the call it
        replays). See :class:`~kernelattn_core.redraw.RedrawPolicy`.
    seed : int, optional
        Seed of the redraw policy. ``None`` takes one from the global torch generator;
        inside an initialised :mod:`torch.distributed` process group it is broadcast
        from rank 0 (a collective: build the model on every rank, or pass a seed), so
        every replica draws the same features (:func:`~kernelattn_core.redraw.agreed_seed`).
    chunk_size : int, optional
        Chunk length of the causal form; ``None`` (the default) takes the engine's
        measured default.
    backend : str, optional
        Force a backend by name (``"torch"``); the fastest available by default.
    scale : float, optional
        See :class:`~kernelattn_core.interfaces.AttentionEstimator`.
    """

    name: ClassVar[str] = "feature-map"
    unbiased: ClassVar[bool] = False
    consistent: ClassVar[bool] = True
    random: ClassVar[bool] = True
    has_budget: ClassVar[bool] = True
    linear: ClassVar[bool] = True
    supports_step: ClassVar[bool | None] = True

    def __init__(
        self,
        feature_map: FeatureMap | type[FeatureMap] | str = "elu",
        normalizer: Normalizer | type[Normalizer] | str | None = None,
        *,
        num_features: int | None = None,
        head_dim: int | None = None,
        redraw_every: int = 0,
        seed: int | None = None,
        chunk_size: int | None = None,
        backend: str | None = None,
        scale: float | None = None,
        **feature_map_options: Any,
    ) -> None:
        super().__init__(scale=scale)
        if isinstance(feature_map, FeatureMap):
            if num_features is not None or feature_map_options:
                raise InputError(
                    "feature_map: num_features and feature-map options go with a registry name, not an instance"
                )
            self.feature_map = feature_map
        else:
            options = dict(feature_map_options)
            if num_features is not None:
                options["num_features"] = num_features
            if not (isinstance(feature_map, type) and issubclass(feature_map, FeatureMap)):
                # a name given here directly (create() passes the class it resolved)
                feature_map = resolve_class(feature_map, "feature_map")
            self.feature_map = construct("feature map", feature_map, "create", options)
        if normalizer is None:
            normalizer = self.feature_map.default_normalizer
        if isinstance(normalizer, Normalizer):
            self.normalizer = normalizer
        elif isinstance(normalizer, type) and issubclass(normalizer, Normalizer):
            self.normalizer = normalizer()
        else:
            self.normalizer = resolve_class(normalizer, "normalizer")()
        self.redraw_policy = RedrawPolicy(redraw_every, seed)
        self.chunk_size = None if chunk_size is None else check_positive_int("chunk_size", chunk_size)
        self.backend = backend
        if head_dim is not None:
            self.redraw_policy.initial(self.feature_map, head_dim)

    @property
    def num_features(self) -> int:
        """The feature budget of the map."""
        return self.feature_map.num_features

    def transform(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled and pre-transformed ``(q, k)`` as the feature map sees them."""
        root = self._input_root(q.shape[-1])
        return self.normalizer.pre(q * root, k * root)

    def step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        state: CausalState | None = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, CausalState]:
        """Causal attention of new positions given the state of the earlier ones (decoding).

        Parameters
        ----------
        q, k, v : Tensor ``[B, H, T, d]``, ``[B, H, T, d]``, ``[B, H, T, dv]``
            The next ``T`` positions (``T = 1`` when decoding token by token).
        state : CausalState, optional
            Returned by the previous call; ``None`` starts a sequence.
        key_padding_mask : Tensor ``[B, T]`` of bool, optional
            Padding among the new positions.

        Returns
        -------
        out : Tensor ``[B, H, T, dv]``
            Equal to the last ``T`` rows of ``forward(..., causal=True)`` over the whole
            sequence so far.
        state : CausalState
            The running sums, to pass to the next call. Runs on the backend a forward
            call would choose (the Triton step for CUDA tensors when Triton imports), in
            eval or training mode alike (no redraw happens between steps).
        """
        if state is not None and not torch.is_grad_enabled() and masks_nothing(key_padding_mask, q):
            fast = self._step_finite(q, k, v, state)
            if fast is not None:
                return fast
        q, k, mask = self._step_inputs(q, k, v, key_padding_mask)
        fm = self.feature_map
        if not fm.built:
            self.redraw_policy.initial(fm, q.shape[-1])
        owner = self.state_owner(q, v)
        if state is not None:
            self._check_state(state, owner, q.device)
        q, k = self._pre(q, k, mask, True)
        fm.prepare(q, k, key_padding_mask=mask, causal=True)
        phi_q, phi_k = fm.raw_features(q, query=True), fm.raw_features(k, query=False)
        problem = Problem(q.device, q.dtype, fm.log_space, True, torch.is_grad_enabled())
        # no new position: the torch backend's step carries the state as it is (no kernel launch)
        backend = select_backend(problem, self.backend if q.shape[2] else "torch")
        self.last_backend = backend.name if backend.load_step is not None else "torch"
        num, den, state = attend_step(
            backend,
            phi_q,
            phi_k,
            v,
            log_space=fm.log_space,
            key_padding_mask=mask,
            state=state,
            chunk_size=self.chunk_size,
            fallback=self._fell_back if self.backend is None else None,
        )
        state.owner = owner
        self._finite_step = self._finite_step_plan(q, v, owner, backend.name)
        return self._post(self.normalizer.normalize(num, den)).to(v.dtype), state

    def _finite_step_plan(self, q: torch.Tensor, v: torch.Tensor, owner: StateOwner, backend: str) -> tuple | None:
        """What :meth:`_step_finite` needs to continue a state this call made (``None`` when
        it cannot: another backend, half precision, or a normaliser, map or subclass that
        adds work of its own to a step)."""
        fm = self.feature_map
        plain = (
            backend == "torch"
            and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64)
            and type(self.normalizer).pre is Normalizer.pre
            and type(self.normalizer).post is Normalizer.post
            and type(self.normalizer).normalize is Normalizer.normalize
            and fm.plain_features()
            and type(self)._step_inputs is AttentionEstimator._step_inputs
        )
        if not plain:
            return None
        b, h, _, d = q.shape
        dv = v.shape[-1]
        return (owner, (b, h, 1, d), (b, h, 1, dv), (b, h, fm.feature_dim, dv), q.dtype)

    def _step_finite(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: object
    ) -> tuple[torch.Tensor, CausalState] | None:
        """One decoding position on :func:`~kernelattn_core.engine.torch_backend.decode_one_finite`,
        or ``None`` for the guarded path of :meth:`step`.

        Taken only for a state of the owner the previous ``step`` of this estimator stated
        (that object, or an equal one: a beam search's reorder restates it), inputs of one
        position with that call's batch, heads, widths and dtype on the CPU, a padding mask
        that pads none of them, no autograd, a state not poisoned and every value finite;
        the guarded path checks and quarantines the rest, with the same result where both
        apply."""
        plan = continued_sums(getattr(self, "_finite_step", None), state, CausalState, q, k, v)
        if plan is None:
            return None
        owner, _, _, _, dtype = plan
        fm = self.feature_map
        root = self._input_root(q.shape[-1])  # read now: scale and eps may change between steps
        eps = self.normalizer.eps if self.normalizer.eps is not None else torch.finfo(dtype).tiny
        phi_q, phi_k = fm._features(q * root, True), fm._features(k * root, False)
        done = decode_one_finite(phi_q, phi_k, v, state, log_space=fm.log_space, eps=eps)
        if done is None:
            return None
        out, state = done
        state.owner = owner
        self.last_backend = "torch"
        return out, state

    def state_owner(self, q: torch.Tensor, v: torch.Tensor) -> StateOwner:
        """The :class:`~kernelattn_core.interfaces.state.StateOwner` of the decoding states
        this estimator makes from ``q [B, H, T, d]`` and ``v [B, H, T, dv]`` (a built map)."""
        fm = self.feature_map
        norm = getattr(self.normalizer, "name", type(self.normalizer).__name__)
        return StateOwner(
            type(self).__name__,
            (("feature_map", fm.name), ("num_features", fm.num_features), ("normalizer", norm)),
            q.shape[0],
            q.shape[1],
            (("D", fm.feature_dim), ("dv", v.shape[-1]), ("d", q.shape[-1])),
        )

    def _check_state(self, state: object, owner: StateOwner, device: torch.device) -> None:
        """Refuse a state this estimator cannot continue (another owner, or fields of the
        wrong shape, type or device), naming ``state``."""
        check_state(state, CausalState, owner)
        assert isinstance(state, CausalState)
        b, h = owner.batch, owner.heads
        widths = dict(owner.widths)
        d_feat, dv = widths["D"], widths["dv"]
        check_state_tensor("kv", state.kv, (b, h, d_feat, dv), device, owner, "[B, H, D, dv]")
        check_state_tensor("z", state.z, (b, h, d_feat), device, owner, "[B, H, D]")
        if self.feature_map.log_space:
            check_state_tensor("m", state.m, (b, h, 1), device, owner, "[B, H, 1] (log-space features)")
        elif state.m is not None:
            raise InputError(f"state: expected m = None (plain features, {owner.describe()}), got a tensor")
        if state.poisoned is not None:
            check_state_tensor("poisoned", state.poisoned, (b, h), device, owner, "[B, H]")
        if isinstance(state.length, bool) or not isinstance(state.length, int) or state.length < 0:
            raise InputError(f"state: expected length to be an int >= 0, got {state.length!r}")

    def _pre(
        self, q: torch.Tensor, k: torch.Tensor, key_padding_mask: torch.Tensor | None, causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``normalizer.pre`` with the causal flag when the normaliser declares it; padded
        keys and non-finite rows never reach it (:func:`~kernelattn_core.engine.naive.isolated_pre`:
        their gradients are 0, not the transform's :math:`0 \\cdot \\mathrm{NaN}`)."""
        if type(self.normalizer).pre is Normalizer.pre:
            return q, k
        options = {"causal": causal} if takes_causal(self.normalizer) else {}
        return isolated_pre(self.normalizer.pre, q, k, key_padding_mask, **options)

    def _post(self, out: torch.Tensor) -> torch.Tensor:
        """``normalizer.post`` (row-wise) that no non-finite row reaches: a NaN row stays
        NaN, and adds nothing (not NaN) to the gradients of the transform's parameters."""
        if type(self.normalizer).post is Normalizer.post:
            return out
        return isolated_rows(self.normalizer.post, out)

    def _attend_scaled(self, q, k, v, root, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        """The factor ``root`` goes to the engine, which applies it group by group, when
        nothing needs the scaled whole inputs first: the normaliser's ``pre`` is the
        identity, the map's ``prepare`` is the base class's no-op or takes the factor itself
        (``prepare_takes_scale``), and ``_attend`` is not overridden."""
        fm_cls = type(self.feature_map)
        if (
            type(self)._attend is not FeatureMapAttention._attend
            or type(self)._pre is not FeatureMapAttention._pre
            or type(self)._attend_features is not FeatureMapAttention._attend_features
            or type(self.normalizer).pre is not Normalizer.pre
            or (fm_cls.prepare is not FeatureMap.prepare and not prepare_takes_scale(fm_cls))
        ):
            return super()._attend_scaled(q, k, v, root, causal, key_padding_mask)
        return self._attend_features(q, k, v, causal, key_padding_mask, root)

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        q, k = self._pre(q, k, key_padding_mask, causal)
        return self._attend_features(q, k, v, causal, key_padding_mask, 1.0)

    def _attend_features(self, q, k, v, causal, key_padding_mask, root):  # type: ignore[no-untyped-def]
        """Feature attention of ``root * q``, ``root * k`` (already through ``pre``)."""
        fm = self.feature_map
        if not fm.built:
            self.redraw_policy.initial(fm, q.shape[-1])
        if self.training:
            # agrees a seed taken before the process group existed (and remakes the draw with
            # it) at the first training call after it, then advances the redraw schedule
            self.redraw_policy.before_forward(fm, self.training)
        try:
            # with root != 1, _attend_scaled made sure that prepare is the base class's no-op or
            # takes the factor (prepare_takes_scale: it sees root * q, root * k, as the engine makes them)
            if prepare_takes_scale(type(fm)):
                fm.prepare(q, k, key_padding_mask=key_padding_mask, causal=causal, scale=root)
            else:
                fm.prepare(q, k, key_padding_mask=key_padding_mask, causal=causal)
            problem = Problem(q.device, q.dtype, fm.log_space, causal, torch.is_grad_enabled())
            prefer = preferred_backend(self, self.backend)  # kernel_attention(backend=) for this call
            backend = select_backend(problem, prefer)
            self.last_backend = backend.name
            # fused (features on chip) when the backend and the map allow it, else materialised;
            # the torch backend normalises group by group
            out = attend_normalized(
                backend,
                fm,
                self.normalizer,
                q,
                k,
                v,
                causal=causal,
                key_padding_mask=key_padding_mask,
                chunk_size=self.chunk_size,
                scale=root,
                fallback=self._fell_back if prefer is None else None,
            )
        finally:
            if self.training:
                # a checkpoint recompute that showed the map an earlier call's draws (or A)
                # puts the last call's back now: its graph holds the tensors it used (the
                # grouped engine its own copies), and a backward pass that raises later, or
                # a recompute stopped early, leaves no earlier call's draws in the map
                self.redraw_policy.end_replay(fm)
        return self._post(out).to(v.dtype)

    def _fell_back(self, backend: Backend) -> None:
        """The automatically chosen backend could not run the call; ``backend`` ran it."""
        self.last_backend = backend.name
