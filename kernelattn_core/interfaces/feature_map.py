"""The :class:`FeatureMap` interface: random or learned features with
:math:`\\mathbb{E}[\\phi_q(x)^\\top \\phi_k(y)] \\approx K(x, y)`.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import InputError, PluginError
from ..validation import check_budget, check_head_dim, check_positive_int, check_tensor, isolated_rows
from .kernel import Kernel
from .names import resolve_class
from .state import add_family_marker

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FusedFeatureSpec:
    """What a fused backend needs to compute a map's features on chip from ``x`` and ``ω``.

    Two families cover the positive and the trigonometric maps. With
    :math:`x' = \\mathrm{transform}(x)` (``[..., d']``, differentiable torch code run
    before the kernel) and :math:`u = x' \\omega^\\top` (``[..., D]``):

    * ``"exp"`` (log-space maps): :math:`\\log\\phi(x)_i = u_i + \\beta(x)`, with the
      per-row offset :math:`\\beta = \\mathrm{row}(x) \\in \\mathbb{R}` (``[...]``);
    * ``"trig"``: :math:`\\phi(x)_i = \\rho(x) \\cos(u_i + b_i)`, with the per-row
      factor :math:`\\rho = \\mathrm{row}(x)` and the phase ``b [D]``
      (:math:`\\sin u = \\cos(u - \\pi/2)`; ``None`` means zero).

    Two-sided maps (:math:`\\pm\\omega`) state ``omega`` with both signs; the
    :math:`[N, D]` features then never go to memory, only ``x'`` ``[N, d']``, the row
    term ``[N]`` and ``omega`` ``[D, d']``.

    Attributes
    ----------
    family : {"exp", "trig"}
    omega : Tensor ``[D, d']``
        The frequencies, one row per feature (no gradient flows to it).
    transform : callable
        ``(x, query: bool) -> x'``, ``[..., d]`` to ``[..., d']`` (``A x`` for CEXP).
    row : callable
        ``(x', query: bool) -> [...]``: the offset (``"exp"``) or factor (``"trig"``).
    phase : Tensor ``[D]`` or None
    """

    family: str
    omega: torch.Tensor
    transform: Callable[[torch.Tensor, bool], torch.Tensor]
    row: Callable[[torch.Tensor, bool], torch.Tensor]
    phase: torch.Tensor | None = None


class _Unbuilt:
    """What an unbuilt :class:`FeatureMap` holds (its attributes and the contents of its
    parameter, buffer and submodule tables), to undo a build that raised."""

    _TABLES = ("_parameters", "_buffers", "_modules")

    def __init__(self, fm: nn.Module) -> None:
        self.attrs = dict(fm.__dict__)
        self.tables = {t: dict(getattr(fm, t)) for t in self._TABLES}
        self.non_persistent = set(fm._non_persistent_buffers_set)

    def restore(self, fm: nn.Module) -> None:
        fm.__dict__.clear()
        fm.__dict__.update(self.attrs)
        for t, entries in self.tables.items():
            table = getattr(fm, t)
            table.clear()
            table.update(entries)
        fm._non_persistent_buffers_set.clear()
        fm._non_persistent_buffers_set.update(self.non_persistent)
        with torch.no_grad():
            fm._built_head_dim.fill_(-1)


class FeatureMap(nn.Module, ABC):
    """Abstract feature map :math:`\\phi: \\mathbb{R}^d \\to \\mathbb{R}^D`.

    A feature map has a query map :math:`\\phi_q` and a key map :math:`\\phi_k` (they
    differ for asymmetric maps such as CEXP) such that

    .. math:: \\hat K(x, y) = \\phi_q(x)^\\top \\phi_k(y) \\approx K(x, y).

    Construction binds the options; the head dimension ``d`` completes it, either at
    construction (``head_dim=...``) or on first use (:meth:`build`), so that
    ``create("prf", num_features=64)`` works without knowing ``d``.

    **Randomness is explicit**: :meth:`redraw` is the only place where random draws
    happen, and draws are registered buffers, so they move with ``.to()`` and are
    saved in ``state_dict``. A state dict can be loaded into a map that has not been
    built yet: it is built from the saved head dimension first.

    **Budgets.** ``num_features`` and ``num_features × head_dim`` (the size of a
    projection draw) must not exceed
    :data:`~kernelattn_core.validation.MAX_DRAW_ELEMENTS` (:math:`2^{28}` values, 2 GiB in
    float64); a larger budget is refused with :class:`~kernelattn_core.errors.InputError`
    giving the size it would need, instead of reaching the allocator. A map whose
    :meth:`_build` allocates more than that (a ``[C, d, d]`` parameter, a network's
    hidden layers) lists its tensors in :meth:`_build_budget`; they are held to the same
    bound before :meth:`_build` runs.

    Subclasses implement :meth:`_build` (allocate parameters and buffers),
    :meth:`_redraw` (fill the random buffers), :meth:`_feature_dim` and
    :meth:`_features`.

    **Token by token.** :meth:`_features` maps each position on its own (the features of
    row ``i`` depend on row ``i`` of the input only), deterministically between redraws,
    and every trainable tensor it uses is one of the map's ``parameters()``. The engine
    relies on this: it computes the features of a group of positions at a time and
    recomputes them in the backward pass (:mod:`kernelattn_core.engine.grouped`).
    Statistics over a whole batch belong in :meth:`prepare`.

    The class attributes below are capability data, checked by the registry and the
    conformance kit.

    Attributes
    ----------
    name : str
        Unique registry name.
    kernel : str or None
        Registry name of the kernel the map targets; ``None`` when the map is a
        deterministic map with no random target (``elu``).
    target_kernel_class : type or None
        The :class:`~kernelattn_core.interfaces.Kernel` subclass the map targets, declared
        as a class (spec 1.1's additions): :meth:`target_kernel` then builds it without a registry
        lookup. ``None`` (the default) resolves ``kernel`` through the registry.
    unbiased : bool
        Whether :math:`\\mathbb{E}[\\hat K(x, y)] = K(x, y)` exactly.
    positive : bool
        Whether every feature is :math:`> 0` (so that attention denominators are positive).
    learnable : bool
        Whether the map has trainable parameters.
    random : bool
        Whether :meth:`redraw` draws anything.
    log_space : bool
        Whether :meth:`_features` returns :math:`\\log \\phi` instead of :math:`\\phi`
        (positive maps of the form :math:`\\exp(\\cdot)`). The engine then applies exact,
        causal-safe stabilisers.
    has_budget : bool
        Whether ``num_features`` sets the feature count.
    default_normalizer : str
        Registry name of the normaliser feature-map attention uses with this map unless
        told otherwise (``"row"``; signed maps may name one that handles denominators
        near zero).
    prepare_takes_scale : bool
        Whether :meth:`prepare` accepts a keyword ``scale`` (a float, 1 by default) and
        then treats the inputs it is given as ``scale * q`` and ``scale * k``. Feature-map
        attention then leaves the estimator's factor :math:`\\sqrt{s}` to the engine (which
        applies it group by group, with no scaled copy of the whole inputs) and calls
        ``prepare(q, k, ..., scale=root)`` with the unscaled inputs. ``False`` (the
        default): a map that overrides :meth:`prepare` is given scaled copies of the
        inputs, and :meth:`prepare` is called without ``scale``. The flag counts only in
        the body of the class that defines the ``prepare`` in use (a subclass overriding
        ``prepare`` inherits no promise; :func:`prepare_takes_scale`).
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    kernel: ClassVar[str | None] = None
    target_kernel_class: ClassVar[type[Kernel] | None] = None
    unbiased: ClassVar[bool] = False
    positive: ClassVar[bool] = False
    learnable: ClassVar[bool] = False
    random: ClassVar[bool] = True
    log_space: ClassVar[bool] = False
    has_budget: ClassVar[bool] = True
    default_num_features: ClassVar[int] = 256
    default_normalizer: ClassVar[str] = "row"
    prepare_takes_scale: ClassVar[bool] = False
    claims: ClassVar[tuple[Any, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # decided once per class (prepare_takes_scale): read per call as a class attribute
        cls._prepare_scale_verdict = _prepare_scale_verdict(cls)

    def __init__(
        self,
        head_dim: int | None = None,
        num_features: int | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if num_features is None:
            num_features = self.default_num_features
        self.num_features = check_budget("num_features", num_features)
        self.head_dim: int | None = None
        # -1 until built; persistent so that a state dict remembers the head dimension
        self.register_buffer("_built_head_dim", torch.tensor(-1, dtype=torch.long))
        # the state dict names the map, and another map's checkpoint is refused (before the build below)
        add_family_marker(self)
        self.register_load_state_dict_pre_hook(_build_before_load)
        if head_dim is not None:
            self.build(head_dim, generator=generator)

    # ------------------------------------------------------------------ lifecycle
    def state_family(self) -> str:
        """The family ``state_dict`` names (``load_state_dict`` refuses another family's
        checkpoint, naming both): the registry name."""
        return getattr(type(self), "name", type(self).__qualname__)

    @property
    def built(self) -> bool:
        """Whether the head dimension is known and the parameters exist."""
        return self.head_dim is not None

    def build(self, head_dim: int, *, generator: torch.Generator | None = None) -> None:
        """Complete the map for head dimension ``head_dim`` and make the first draw.

        A build that raises (a ``_build`` or first draw refusing ``head_dim``) leaves
        the map as it was, unbuilt: the attributes, parameters, buffers and submodules
        it had set are removed, so the same call raises the same error again and
        another ``head_dim`` may build afterwards.
        """
        check_positive_int("head_dim", head_dim)
        if not self.built:  # the draws are about num_features x head_dim values (a projection matrix)
            check_budget("num_features", self.num_features, head_dim, "head_dim")
            for name, value, per_unit, what in self._build_budget(head_dim):  # larger tensors of _build
                check_budget(name, value, per_unit, what)
        if self.built:
            if head_dim != self.head_dim:
                raise InputError(f"head_dim: {self.name!r} was built for d = {self.head_dim}, got d = {head_dim}")
            return
        saved = _Unbuilt(self)
        try:
            # normal tensors even when the first call runs under torch.inference_mode(): an
            # inference tensor buffer could never be saved for a later training step's backward
            with torch.inference_mode(False):
                self.head_dim = head_dim
                if self._built_head_dim.is_inference():  # the map was made under inference_mode
                    self._built_head_dim = self._built_head_dim.clone()
                self._built_head_dim.fill_(head_dim)
                self._build(head_dim)
                self.redraw(generator=generator)
        except BaseException:
            saved.restore(self)
            raise

    def redraw(self, *, generator: torch.Generator | None = None) -> None:
        """Draw fresh random features (no-op for deterministic maps).

        Parameters
        ----------
        generator : torch.Generator, optional
            Source of randomness; the global generator when ``None``. Draws are made on
            the generator's device and copied into the buffers, so a CPU generator
            gives the same draws whatever device the module lives on.
        """
        if not self.built:
            raise InputError(f"{self.name!r}: redraw() needs the head dimension; call build(head_dim) first")
        with torch.no_grad():
            self._redraw(generator)

    def _build(self, head_dim: int) -> None:
        """Allocate parameters and buffers for head dimension ``head_dim``."""

    def _build_budget(self, head_dim: int) -> Iterable[tuple[str, int, int, str]]:
        """The tensors :meth:`_build` (and the first draw) would allocate beyond
        ``num_features × head_dim`` values, as ``(name, value, per_unit, what)``: the
        argument that sets the size, its value, the values per unit of it and what that
        factor is, for the message. :meth:`build` refuses, before :meth:`_build` runs, a
        tensor of ``value × per_unit`` values over
        :data:`~kernelattn_core.validation.MAX_DRAW_ELEMENTS`. The default lists nothing."""
        return ()

    def _redraw(self, generator: torch.Generator | None) -> None:
        """Fill the random buffers (called under ``torch.no_grad``)."""

    def prepare(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> None:
        """See the queries and keys of a forward call before their features are made.

        Called by feature-map attention with the scaled, pre-transformed
        ``q [B, H, N, d]`` and ``k [B, H, M, d]``, the call's ``key_padding_mask``
        (``[B, M]``, ``True`` = padded; padded keys must not enter any statistic) and
        its ``causal`` flag (statistics of the current sequence would leak later
        tokens into earlier outputs, so causal calls may only use statistics of
        earlier batches). Data-adapted maps (CEXP) update their statistics here in
        training mode and keep them frozen in eval mode. The default does nothing.

        A map that declares ``prepare_takes_scale = True`` also accepts ``scale`` (a
        float, 1 by default): ``q`` and ``k`` are then unscaled, and what it sees is
        ``scale * q`` and ``scale * k``.
        """

    # ------------------------------------------------------------------ helpers for subclasses
    def _draw(
        self,
        kind: str,
        shape: tuple[int, ...],
        like: torch.Tensor,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        """Draw ``normal``, ``uniform`` or ``rademacher`` samples of ``shape`` with the
        dtype and device of ``like``.

        Samples are drawn in float64 on the generator's device (CPU by default) and then
        cast, so one generator seed gives the same draws (up to rounding) whatever the
        module's dtype and device.
        """
        device = generator.device if generator is not None else torch.device("cpu")
        dtype = torch.float64
        if kind == "normal":
            out = torch.randn(shape, generator=generator, device=device, dtype=dtype)
        elif kind == "uniform":
            out = torch.rand(shape, generator=generator, device=device, dtype=dtype)
        elif kind == "rademacher":
            out = torch.randint(0, 2, shape, generator=generator, device=device).to(dtype) * 2 - 1
        else:  # pragma: no cover - programming error
            raise ValueError(f"kind: expected 'normal', 'uniform' or 'rademacher', got {kind!r}")
        return out.to(device=like.device, dtype=like.dtype)

    # ------------------------------------------------------------------ public maps
    @property
    def feature_dim(self) -> int:
        """The number of features :math:`D` (for example ``2 m`` for two-sided maps)."""
        if not self.built:
            raise InputError(f"{self.name!r}: feature_dim is known once the head dimension is (build(head_dim))")
        return self._feature_dim()

    @abstractmethod
    def _feature_dim(self) -> int:
        """The number of features for the built map."""

    @abstractmethod
    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        """Features (or log-features when ``log_space``) of validated ``x [..., d]``,
        giving ``[..., D]``."""

    def _checked(self, x: torch.Tensor, arg: str) -> torch.Tensor:
        check_tensor(arg, x)
        if x.dim() < 1:
            raise InputError(f"{arg}: expected a tensor [..., d], got a scalar")
        if not self.built:
            self.build(x.shape[-1])
        check_head_dim(arg, x, self.head_dim)
        return x.float() if x.dtype in _HALF else x

    def _log(self, x: torch.Tensor, is_query: bool, arg: str) -> torch.Tensor:
        if not self.log_space:
            raise InputError(f"{self.name!r}: log features are defined only for log-space maps (log_space=True)")
        return self._isolated(self._checked(x, arg), is_query)

    def _isolated(
        self, x: torch.Tensor, is_query: bool, fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """:meth:`_features` (or ``fn``) of checked ``x [..., d]``, a non-finite input row
        kept away from the map: it is replaced by 0 before the map and its feature row set
        to NaN after it.

        The feature row is what it would have been (non-finite, so the engine drops the
        key or poisons the query's row), but the map's own backward pass never sees the
        NaN or inf: the row's gradient is exactly 0 (:math:`0 \\cdot \\mathrm{NaN}` would
        make it NaN) and a learned map's parameter gradients stay finite whatever a masked
        or later position holds. One reduction over ``x`` decides; the map runs once.
        """
        return isolated_rows(fn or (lambda t: self._features(t, is_query)), x)

    def plain_features(self) -> bool:
        """Whether, for finite input of the map's dtype, :meth:`raw_features` is
        :meth:`_features` itself: the map keeps the base class's :meth:`prepare` (no
        statistics of the call), :meth:`raw_features` and :meth:`_isolated`. The decoding
        short paths call :meth:`_features` directly only then."""
        cls = type(self)
        return (
            cls.prepare is FeatureMap.prepare
            and cls.raw_features is FeatureMap.raw_features
            and cls._isolated is FeatureMap._isolated
        )

    def raw_features(self, x: torch.Tensor, *, query: bool) -> torch.Tensor:
        """What the engine consumes: features, or log-features for log-space maps,
        in float32 for half inputs (``[..., d]`` to ``[..., D]``). A row of ``x`` holding
        NaN or inf gives a NaN row, with a zero gradient (see :meth:`_isolated`)."""
        return self._isolated(self._checked(x, "q" if query else "k"), query)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """:math:`\\phi_q(x)` for ``x [..., d]``, giving ``[..., D]`` in the dtype of ``x``."""
        f = self._isolated(self._checked(x, "x"), True)
        return (f.exp() if self.log_space else f).to(x.dtype)

    def key(self, x: torch.Tensor) -> torch.Tensor:
        """:math:`\\phi_k(x)` for ``x [..., d]``, giving ``[..., D]`` in the dtype of ``x``."""
        f = self._isolated(self._checked(x, "x"), False)
        return (f.exp() if self.log_space else f).to(x.dtype)

    def query_log(self, x: torch.Tensor) -> torch.Tensor:
        """:math:`\\log \\phi_q(x)` (log-space maps only; float32 for half inputs)."""
        return self._log(x, True, "x")

    def key_log(self, x: torch.Tensor) -> torch.Tensor:
        """:math:`\\log \\phi_k(x)` (log-space maps only; float32 for half inputs)."""
        return self._log(x, False, "x")

    def fused_spec(self) -> FusedFeatureSpec | None:
        """How a fused backend computes this map's features on chip, or ``None``.

        ``None`` (the default) makes fused backends use materialised features from
        :meth:`raw_features`. A map that returns a spec promises that the spec's
        features equal :meth:`raw_features` (up to the order of the features, which no
        attention output depends on); see :class:`FusedFeatureSpec`.
        """
        return None

    def target_kernel(self) -> Kernel:
        """The exact kernel this map estimates, as configured (options, learned parameters).

        The default builds ``target_kernel_class`` when the map declares it, else the
        kernel the registry has under the name ``kernel``, with default options; maps
        whose target depends on options (a lengthscale) or on learned parameters
        (mixture components) override this.
        """
        if self.target_kernel_class is not None:
            return self.target_kernel_class()
        if self.kernel is None:
            raise InputError(f"{self.name!r}: the map declares no target kernel (kernel = None)")
        return resolve_class(self.kernel, "kernel")()

    def exact_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The exact target :math:`K(x_i, y_j)`, ``[..., N, M]``, for the map's current
        configuration: what :meth:`kernel_estimate` estimates. Uses :meth:`target_kernel`."""
        return self.target_kernel()(x, y)

    def kernel_estimate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """:math:`\\hat K(x_i, y_j) = \\phi_q(x_i)^\\top \\phi_k(y_j)`, ``[..., N, M]``."""
        return self.query(x) @ self.key(y).transpose(-1, -2)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_features={self.num_features}"


def prepare_takes_scale(cls: type) -> bool:
    """Whether feature-map attention may call ``cls.prepare(q, k, ..., scale=s)`` on the
    unscaled inputs (:attr:`FeatureMap.prepare_takes_scale`).

    The promise belongs to the class that defines the ``prepare`` in use: a subclass that
    overrides ``prepare`` without declaring ``prepare_takes_scale = True`` in its own body
    is given scaled copies and no ``scale``, as before the flag existed, whatever its
    parents declare. A class that declares the flag beside a ``prepare`` that takes no
    ``scale`` keyword is refused with :class:`~kernelattn_core.errors.PluginError`
    naming both. Decided once per class, when it is defined (a class attribute: no
    lookup per call, nothing for ``torch.compile`` to trace).
    """
    verdict = cls.__dict__.get("_prepare_scale_verdict")
    if verdict is None:  # a class made without FeatureMap.__init_subclass__ (not expected)
        verdict = _prepare_scale_verdict(cls)
    if isinstance(verdict, str):
        raise PluginError(verdict)
    return verdict


def _prepare_scale_verdict(cls: type) -> bool | str:
    """:func:`prepare_takes_scale`'s answer for ``cls``, or the refusal's message."""
    owner = next((c for c in cls.__mro__ if "prepare" in vars(c)), FeatureMap)
    if owner is FeatureMap or not vars(owner).get("prepare_takes_scale", False):
        return False
    params = inspect.signature(owner.prepare).parameters.values()
    if not any(p.name == "scale" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return (
            f"{cls.__qualname__}: {owner.__qualname__} declares prepare_takes_scale = True but its prepare "
            "takes no scale keyword; accept scale (a float, 1 by default: q and k are then the unscaled "
            "inputs) or drop the flag"
        )
    return True


def _build_before_load(module: FeatureMap, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: build an unbuilt map from the saved head dimension."""
    key = prefix + "_built_head_dim"
    if not module.built and key in state_dict and int(state_dict[key]) > 0:
        module.build(int(state_dict[key]))
        # load_state_dict copies into the existing tensors, keeping their dtype: give the
        # freshly built ones the saved floating dtype so the round trip is exact
        saved = {v.dtype for k, v in state_dict.items() if k.startswith(prefix) and v.is_floating_point()}
        if len(saved) == 1:
            module.to(saved.pop())
