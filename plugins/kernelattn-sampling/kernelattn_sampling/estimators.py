"""The estimators: ``ra``, ``ra-biased``, ``rfa-snis`` and ``lara``.

All work in the core's scaled coordinates (q and k multiplied by :math:`d^{-1/4}`),
where every Gaussian of the paper has unit covariance. Randomness comes at forward
time, in training mode: training call ``r`` draws from the CPU generator
:func:`~kernelattn_core.redraw.generator_for` ``(seed, r)``, so replicas that share the
``seed`` (agreed by the core's :class:`~kernelattn_core.redraw.RedrawPolicy` when it is
``None``) draw the same samples, and the global torch generator is never touched. An
explicit ``generator`` option replaces the seeded schedule.

A non-finite value at a padded or (causal) future position never reaches an output:
padded keys and values are replaced before any product, disallowed logits are
*replaced* by :math:`-\\infty` (never added to), and value sums skip non-finite
entries that a row may not see (:func:`~kernelattn_sampling.functional.visible_matmul`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from kernelattn_core import AttentionEstimator, InputError
from kernelattn_core.toolkit import (
    ConsistentAttention,
    MapState,
    PendingDraws,
    QuadratureIdentity,
    RedrawPolicy,
    SymbolicExpectation,
    UnbiasedAttention,
    allowed_pairs,
    check_choice,
    check_positive_int,
    checkpoint_token,
    compute_dtype,
    finite_rows,
    generator_for,
    poison_rows,
    quarantine_non_finite,
    recomputing,
)

from . import functional as fn
from .chunked import ra_blocked, use_blocks
from .lara import (
    NEGATIVE_POLICIES,
    PROPOSALS,
    R_AXES,
    WEIGHTINGS,
    lara_from_samples,
    make_proposals,
    pooled_means,
    segment_means,
)
from .theory import CONSISTENCY_CLAIMS, derive_lemma_a1_1d, ra_quadrature, target_density_mass

NOISE_CHOICES = ("paper", "code")


def _check_noise(noise_std: object) -> float | str:
    if noise_std in NOISE_CHOICES:
        return noise_std  # type: ignore[return-value]
    if (
        isinstance(noise_std, bool)
        or not isinstance(noise_std, int | float)
        or not math.isfinite(noise_std)
        or noise_std < 0
    ):
        raise InputError(f"noise_std: expected 'paper', 'code' or a finite number >= 0, got {noise_std!r}")
    return float(noise_std)


def _check_generator(generator: object) -> torch.Generator | None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise InputError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    return generator


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name}: expected a bool, got {value!r}")
    return value


class _Draws(nn.Module):
    """The seeded draw schedule of a sampling estimator.

    ``seed`` lives in a :class:`~kernelattn_core.redraw.RedrawPolicy` (a buffer, saved in
    ``state_dict``; agreed across data-parallel ranks by the core when ``None``, at the
    first training call after the process group exists when the estimator was built
    before it); training call number ``r`` draws from ``generator_for(seed, r)``. An
    explicit ``generator`` (mutually exclusive with ``seed``) is used as given instead.

    The recompute of an activation checkpoint (a forward call inside a backward pass,
    :func:`~kernelattn_core.redraw.recomputing`) is not a new call: it gets the generator
    of the call it recomputes again (the explicit generator's state before that call) and
    advances nothing, so it redraws exactly the samples of the forward pass it replays.
    A training call inside a checkpoint records its call number (or generator state)
    under that checkpoint (:class:`~kernelattn_core.redraw.PendingDraws`, dropped with the
    checkpoint's graph), so several checkpointed calls before one backward pass each get
    their own; a recompute that cannot be matched while pending calls drew differently
    raises :class:`~kernelattn_core.errors.ReplayError`.
    """

    def __init__(self, seed: int | None, generator: torch.Generator | None) -> None:
        super().__init__()
        generator = _check_generator(generator)
        if generator is not None and seed is not None:
            raise InputError(f"seed: give either seed or generator, not both; got seed={seed!r} and a generator")
        self.generator = generator
        self.policy = RedrawPolicy(0, seed)
        self.register_buffer("calls", torch.tensor(0, dtype=torch.long))
        #: the explicit generator's state before the last training call (a recompute replays it)
        self._last_state: torch.Tensor | None = None
        #: the draws of checkpointed training calls whose recompute may still come
        self._pending = PendingDraws()
        #: called when the seed is agreed anew across ranks (the owner's derived seeds follow it)
        self.on_seed_agreed: Callable[[], None] | None = None

    @property
    def seed(self) -> int:
        return int(self.policy.seed)

    def derived_seed(self, stream: int) -> int:
        """A fixed 62-bit seed for stream ``stream`` (evaluation draws), from ``seed``."""
        g = generator_for(self.seed, -1 - stream)
        return int(torch.randint(0, 2**62, (), generator=g, dtype=torch.long))

    def next(self) -> torch.Generator:
        """The generator of the next training call (advances the schedule); in a checkpoint
        recompute, the generator of the call it recomputes again (advances nothing)."""
        if recomputing():
            replay = self._replay()
            if replay is not None:
                return replay
        if self.training and self.policy.agree() and self.on_seed_agreed is not None:
            self.on_seed_agreed()  # built before the process group: every rank now shares the seed
        if self.generator is not None:
            if not torch.compiler.is_compiling():
                self._last_state = self.generator.get_state()
                self._note(self._last_state)
            return self.generator
        call = int(self.calls)
        g = generator_for(self.seed, call)
        self.calls += 1
        self._note((self.seed, call))
        return g

    def _note(self, draws: object) -> None:
        """Record ``draws`` for the recompute, when this call runs inside a checkpoint."""
        token = checkpoint_token()
        if token is not None:
            self._pending.add(token, draws)

    def _latest(self) -> object | None:
        """The draws of the last training call (``None``: no call yet)."""
        if self.generator is not None:
            return self._last_state
        calls = int(self.calls)
        return (self.seed, calls - 1) if calls > 0 else None

    def _replay(self) -> torch.Generator | None:
        """The generator of the call the current recompute replays, as it was then (that of
        the last training call when the recompute is not matched and no other pending
        call drew differently; ``None``: no call yet)."""
        latest = self._latest()
        if latest is None:
            return None
        want = self._pending.replay(latest, "the sampling estimator's draws")
        if torch.is_tensor(want):
            device = self.generator.device if self.generator is not None else torch.device("cpu")
            g = torch.Generator(device=device)
            g.set_state(want)
            return g
        return generator_for(*want)  # type: ignore[misc]

    def extra_repr(self) -> str:
        return "generator=explicit" if self.generator is not None else f"seed={self.seed}"


class _SamplingEstimator(AttentionEstimator):
    """Shared options: the budget, the noise scale, the generator and a saved eval seed."""

    random: ClassVar[bool] = True
    has_budget: ClassVar[bool] = True
    default_num_features: ClassVar[int] = 1

    def __init__(
        self,
        num_features: int | None = None,
        *,
        noise_std: float | str = "paper",
        seed: int | None = None,
        generator: torch.Generator | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__(scale=scale)
        self.num_features = check_positive_int(
            "num_features", self.default_num_features if num_features is None else num_features
        )
        self.noise_std = _check_noise(noise_std)
        self.draws = _Draws(seed, generator)
        # seed of the fixed evaluation draws, derived from the seed; a buffer, so state_dict carries it
        self.register_buffer("eval_seed", torch.tensor(self.draws.derived_seed(0), dtype=torch.long))
        self.draws.on_seed_agreed = self._derive_eval_seed

    def _derive_eval_seed(self) -> None:
        """Derive ``eval_seed`` again from the (newly agreed) seed."""
        self.eval_seed.fill_(self.draws.derived_seed(0))

    @property
    def generator(self) -> torch.Generator | None:
        """The explicit generator option (``None``: the seeded schedule)."""
        return self.draws.generator

    def _sigma(self, head_dim: int) -> float:
        return fn.noise_std_value(self.noise_std, head_dim)

    def extra_repr(self) -> str:
        return f"num_features={self.num_features}, noise_std={self.noise_std!r}, scale={self.scale}"


class RandomizedAttention(_SamplingEstimator):
    """Randomized attention (RA): an unbiased estimator of softmax attention.

    The target of each query is the Gaussian mixture (Eq. 5)

    .. math:: p_n(\\omega) = \\sum_m \\pi_{nm}\\, N(\\omega; q_n + k_m, I), \\qquad
              \\pi_{nm} = \\mathrm{softmax}_m(q_n^\\top k_m),

    and softmax attention is exactly :math:`\\mathbb E_{p_n}[f(\\omega)]` (Prop. 3.2) with

    .. math:: f(\\omega) = \\sum_m \\mathrm{softmax}_m(\\omega^\\top k_m - \\tfrac12\\|k_m\\|^2)\\, v_m .

    RA averages :math:`f` over ``S = num_features`` exact draws (Eq. 30):
    :math:`z \\sim \\mathrm{Categorical}(\\pi_n)`, :math:`\\omega = q_n + k_z + \\epsilon`,
    :math:`\\epsilon \\sim N(0, I)`. Cost :math:`O(S N M d)` time, :math:`O(S N M)` memory.

    Parameters
    ----------
    num_features : int
        ``S``, samples per query (1, the paper's setting, by default).
    noise_std : {"paper", "code"} or float
        Standard deviation of :math:`\\epsilon` in the scaled coordinates: 1 (``"paper"``,
        unbiased) or :math:`d^{-1/4}` (``"code"``: the released code, which is biased).
    eval_noise : bool
        Whether evaluation draws include :math:`\\epsilon` (the released code omits it; default).
    eval_resample : bool
        Evaluation indices are always sampled (the paper: "has to draw random indices
        even during evaluation"). By default they are position-addressed hashes of a
        seed saved in ``state_dict`` (``eval_seed``), so evaluation is deterministic
        (like a fixed evaluation sample set), causal prefixes see the same draws, and
        devices agree; ``True`` draws fresh ones from the generator.
    seed : int, optional
        Seed of the training draws and of ``eval_seed``; ``None`` takes one from the
        global generator at construction (agreed across ranks, see the module notes).
    generator : torch.Generator, optional
        Explicit source of the training draws instead of the seeded schedule.
    scale : float, optional
        See :class:`~kernelattn_core.interfaces.AttentionEstimator`.

    Notes
    -----
    Claims: unbiased for softmax attention (AT001, Monte Carlo at d = 4); the target
    density reproduces softmax attention to 30 digits in 1-D (HP001); Lemma A.1
    symbolically (FM005).

    References
    ----------
    Zheng, Wang, Kong, "Linear Complexity Randomized Self-attention Mechanism", ICML 2022.

    Examples
    --------
    >>> import torch, kernelattn_core as ka
    >>> est = ka.create("ra", num_features=2)
    >>> est(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)).shape
    torch.Size([1, 2, 5, 8])
    """

    name: ClassVar[str] = "ra"
    aliases: ClassVar[tuple[str, ...]] = ("randomized-attention",)
    unbiased: ClassVar[bool] = True
    consistent: ClassVar[bool] = True
    supports_causal: ClassVar[bool] = True
    linear: ClassVar[bool] = False
    sample_index: ClassVar[bool] = True
    unbiased_modes: ClassVar[tuple[str, ...]] = ("train",)  # eval drops the noise unless eval_noise=True
    claims: ClassVar[tuple[Any, ...]] = (
        UnbiasedAttention(dim=4, seq_len=6, num_features=1),
        UnbiasedAttention(dim=4, seq_len=6, num_features=1, mode="eval", expect="fail"),
        UnbiasedAttention(dim=4, seq_len=6, num_features=1, mode="eval", options={"eval_noise": True}),
        QuadratureIdentity(evaluate=ra_quadrature, label="E_{p_n}[f] == softmax attention (1-D, Prop. 3.2)"),
        QuadratureIdentity(evaluate=target_density_mass, label="RA target p_n integrates to 1 (1-D)"),
        SymbolicExpectation(derive=derive_lemma_a1_1d),
    )

    def __init__(
        self,
        num_features: int | None = None,
        *,
        noise_std: float | str = "paper",
        eval_noise: bool = False,
        eval_resample: bool = False,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__(num_features, noise_std=noise_std, seed=seed, generator=generator, scale=scale)
        self.eval_noise = _check_bool("eval_noise", eval_noise)
        self.eval_resample = _check_bool("eval_resample", eval_resample)

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        self.last_backend = "torch"
        dtype = compute_dtype(q.dtype)
        q, k, v32 = q.to(dtype), k.to(dtype), v.to(dtype)
        k, v32 = fn.drop_padded(k, v32, key_padding_mask)
        allowed = allowed_pairs(q.shape[2], k.shape[2], causal, key_padding_mask, q.device)
        q, k, v32, poison = quarantine_non_finite(q, k, v32, allowed)  # NaN rows cannot reach other gradients
        out, overflow = self._ra(q, k, v32, causal, key_padding_mask)
        if overflow is not None:
            poison = overflow if poison is None else poison | overflow
        return poison_rows(out, poison).to(v.dtype)

    def _ra(self, q, k, v32, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        """``(out, overflow rows or None)``."""
        fixed = not self.training and not self.eval_resample
        if use_blocks(q.shape[2], k.shape[2], self.num_features):  # memory-bounded, same estimator
            return ra_blocked(
                q,
                k,
                v32,
                key_padding_mask,
                causal,
                self.num_features,
                self._sigma(q.shape[-1]),
                None if fixed else self.draws.next(),
                noise=self.training or self.eval_noise,
                counter_seed=int(self.eval_seed) if fixed else None,
            )
        probs = fn.softmax_probs(q, k, key_padding_mask, causal)  # [B, H, N, M]
        omega = fn.ra_samples(
            q,
            k,
            probs,
            self.num_features,
            self._sigma(q.shape[-1]),
            None if fixed else self.draws.next(),
            sample_index=True,
            noise=self.training or self.eval_noise,
            counter_seed=int(self.eval_seed) if fixed else None,
        )  # [B, H, N, S, d]
        return fn.ra_from_samples_isolated(omega, k, v32, key_padding_mask, causal)


class RandomizedAttentionBiased(_SamplingEstimator):
    """RA-biased (Eq. 31): the index replaced by its mean.

    .. math:: \\omega_n = q_n + \\sum_m \\pi_{nm} k_m + \\epsilon, \\qquad
              y_n = \\frac1S\\sum_s f(\\omega_{ns})

    Lower variance than RA and a non-negligible bias; in evaluation the mean
    :math:`q_n + K^\\top\\pi_n` is the "sample", so the output is deterministic.

    Parameters
    ----------
    num_features, noise_std, seed, generator, scale
        As for :class:`RandomizedAttention`.

    Notes
    -----
    Not unbiased: the AT001 test of RA is declared on this class as a negative control
    (``expect="fail"``), so ``kernelattn verify`` shows that the test catches it. Not
    consistent either (its bias stays as the budget grows): AT002 is declared as a
    negative control too.
    """

    name: ClassVar[str] = "ra-biased"
    unbiased: ClassVar[bool] = False
    consistent: ClassVar[bool] = False
    supports_causal: ClassVar[bool] = True
    claims: ClassVar[tuple[Any, ...]] = (
        UnbiasedAttention(dim=4, seq_len=6, num_features=1, expect="fail"),
        # not consistent either: the mean index replaces the sampled one at every budget, so
        # the bias stays as num_features grows (AT002 negative control; logit_std 2 makes the
        # bias, about 0.11 at both budgets, larger than what the redraws resolve, about 0.08)
        ConsistentAttention(
            biased_at_finite_budget=True, budgets=(4, 64), logit_std=2.0, independent_rows=True, expect="fail"
        ),
        *CONSISTENCY_CLAIMS["ra-biased"],
    )
    linear: ClassVar[bool] = False

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        self.last_backend = "torch"
        dtype = compute_dtype(q.dtype)
        q, k, v32 = q.to(dtype), k.to(dtype), v.to(dtype)
        k, v32 = fn.drop_padded(k, v32, key_padding_mask)
        allowed = allowed_pairs(q.shape[2], k.shape[2], causal, key_padding_mask, q.device)
        q, k, v32, poison = quarantine_non_finite(q, k, v32, allowed)  # NaN rows cannot reach other gradients
        probs = fn.softmax_probs(q, k, key_padding_mask, causal)
        samples = self.num_features if self.training else 1
        generator = self.draws.next() if self.training else None
        omega = fn.ra_samples(
            q, k, probs, samples, self._sigma(q.shape[-1]), generator, sample_index=False, noise=self.training
        )
        out, overflow = fn.ra_from_samples_isolated(omega, k, v32, key_padding_mask, causal)
        if overflow is not None:
            poison = overflow if poison is None else poison | overflow
        return poison_rows(out, poison).to(v.dtype)


class RFASNIS(AttentionEstimator):
    """Random feature attention (Performer PRF) read as self-normalised importance
    sampling (Prop. 3.1), in the stable log-space form of the spec.

    With :math:`\\omega_s \\sim N(0, I)`:

    .. math:: \\bar y_s = f(\\omega_s),\\quad \\log D_s = \\log\\sum_m \\xi(k_m, \\omega_s),\\quad
              y_n = \\sum_s \\mathrm{softmax}_s\\big(\\omega_s^\\top q_n + \\log D_s\\big)\\,\\bar y_s,

    algebraically identical to Eq. 2. The samples live in a ``prf`` feature map of
    ``kernelattn-prf`` (its ``omega`` buffer): redrawn at every training forward
    call, one fixed set in evaluation (the paper's protocol, App. G.1). Causal calls
    go through the core engine with the same features.

    Parameters
    ----------
    num_features : int
        ``S`` samples (64 by default).
    orthogonal : bool
        Block-orthogonal samples (off by default, as in the paper).
    seed : int, optional
        Seed of the draws: the first build uses draw 0, training call ``r`` redraws
        with draw ``r``; ``None`` takes one at construction (agreed across ranks).
    generator : torch.Generator, optional
        Explicit source of the draws instead of the seeded schedule.
    scale : float, optional

    Notes
    -----
    Biased at finite ``S`` (self-normalisation), consistent: AT002 with
    ``biased_at_finite_budget=True``.
    """

    name: ClassVar[str] = "rfa-snis"
    unbiased: ClassVar[bool] = False
    consistent: ClassVar[bool] = True
    supports_causal: ClassVar[bool] = True
    random: ClassVar[bool] = True
    has_budget: ClassVar[bool] = True
    linear: ClassVar[bool] = True
    default_num_features: ClassVar[int] = 64
    claims: ClassVar[tuple[Any, ...]] = CONSISTENCY_CLAIMS["rfa-snis"]

    def __init__(
        self,
        num_features: int | None = None,
        *,
        orthogonal: bool = False,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__(scale=scale)
        from kernelattn_prf.feature_maps import PositiveRandomFeatures

        self.draws = _Draws(seed, generator)
        budget = self.default_num_features if num_features is None else num_features
        self.features = PositiveRandomFeatures(num_features=budget, orthogonal=_check_bool("orthogonal", orthogonal))

    @property
    def num_features(self) -> int:
        return self.features.num_features

    @property
    def generator(self) -> torch.Generator | None:
        """The explicit generator option (``None``: the seeded schedule)."""
        return self.draws.generator

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        fm = self.features
        if not fm.built:
            fm.build(q.shape[-1], generator=self.draws.next())
        elif q.shape[-1] != fm.head_dim:
            raise InputError(
                f"q: {self.name!r} drew its samples for head dimension d = {fm.head_dim}, got d = {q.shape[-1]} "
                f"(q shape {tuple(q.shape)}); use one estimator per head dimension"
            )
        elif self.training and recomputing():
            # the recompute's draw goes into copies, and the map holds the last call's again
            # right after the recompute's computation, whose graph holds the copies (a
            # backward pass that raises later, or an early-stopped recompute, leaves no
            # earlier call's draw in the map)
            latest = MapState(fm)
            MapState.detach_from(fm)
            try:
                fm.redraw(generator=self.draws.next())
                return self._attend_drawn(q, k, v, causal, key_padding_mask)
            finally:
                latest.show()
        elif self.training:
            fm.redraw(generator=self.draws.next())
        return self._attend_drawn(q, k, v, causal, key_padding_mask)

    def _attend_drawn(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        """The attention with the map's current draw."""
        fm = self.features
        k, v = fn.drop_padded(k, v, key_padding_mask)
        if causal:
            from kernelattn_core.toolkit import Problem, select_backend

            phi_q, phi_k = fm.raw_features(q, query=True), fm.raw_features(k, query=False)
            backend = select_backend(Problem(q.device, phi_q.dtype, True, True, torch.is_grad_enabled()), None)
            self.last_backend = backend.name
            num, den = backend.load()(
                phi_q, phi_k, v, log_space=True, causal=True, key_padding_mask=key_padding_mask, chunk_size=64
            )
            return (num / torch.where(den == 0, torch.ones_like(den), den).unsqueeze(-1)).to(v.dtype)
        self.last_backend = "torch"
        dtype = compute_dtype(q.dtype)
        q, k, v32 = q.to(dtype), k.to(dtype), v.to(dtype)
        allowed = allowed_pairs(q.shape[2], k.shape[2], False, key_padding_mask, q.device)
        q, k, v32, poison = quarantine_non_finite(q, k, v32, allowed)  # NaN rows cannot reach other gradients
        omega = fm.omega.to(dtype=dtype, device=q.device)  # [S, d]
        return poison_rows(fn.rfa_from_samples(q, k, v32, omega, key_padding_mask), poison).to(v.dtype)


class LinearRandomizedAttention(AttentionEstimator):
    """Linear randomized attention (LARA): self-normalised multiple importance sampling
    with ``C`` query-subset proposals and query-specific weights (Eq. 10 / 28).

    .. math:: y_n = \\frac{\\sum_c \\alpha'_{nc}(\\omega_c)\\,\\xi(q_n,\\omega_c) \\sum_m \\xi(k_m,\\omega_c) v_m}
                          {\\sum_c \\alpha'_{nc}(\\omega_c)\\,\\xi(q_n,\\omega_c) \\sum_m \\xi(k_m,\\omega_c)},
              \\qquad \\alpha'_{nc} = \\alpha_{nc}\\,\\frac{N(\\omega_c; 0, I)}{q_c(\\omega_c)}

    (Algorithm 3 as corrected), computed in log space. Proposals :math:`q_c = N(\\mu_c, I)`
    are built from landmarks :math:`\\tilde q_c, \\tilde k_c` (segment means or 2-D
    pooling), with :math:`q_c(\\omega)/N(\\omega;0,I) = \\xi(\\mu_c, \\omega)`.
    Weights (Eq. 38, default):

    .. math:: \\alpha_{nc}(\\omega) = \\frac{q_c(\\omega)}{\\sum_{c'} q_{c'}(\\omega)}
              + \\beta\\Big(r'_{nc} - \\frac1C\\sum_{c'} r'_{nc'}\\Big),\\qquad
              r'_{nc} = \\frac{e^{q_n^\\top\\tilde q_c}}{\\sum_{n'} e^{q_{n'}^\\top\\tilde q_c}} .

    Training draws one sample per proposal (two with ``antithetic``), evaluation uses
    the proposal means (deterministic). Time and memory :math:`O(C(N + M)d)`.
    Non-causal only.

    Parameters
    ----------
    num_features : int
        ``C``, landmarks = proposals = samples (16 by default). With ``N <= C`` (or
        ``M <= C``) the tokens themselves are the landmarks.
    landmarks : {"segment", "pool2d"}
        1-D segment means (the released code's uneven split when ``C`` does not divide
        ``N``) or 2-D adaptive average pooling of an image grid.
    grid : (int, int), optional
        The token grid ``(height, width)`` for ``pool2d`` (``N = M = height * width``).
    pool : (int, int), optional
        The pooled grid; ``(r, r)`` with ``r * r = C`` by default.
    proposal : {"eq34", "eq35", "eq33", "eq32", "standard-normal"}
        Eq. 34 (default), Eq. 35 as corrected, Eq. 33, the mixture Eq. 32 (with the
        tokens as landmarks these are the exact targets), or :math:`N(0, I)` (RFA).
    weighting : {"decoupled", "coupled", "balance", "constant", "delta"}
        Eq. 38 (default), Eq. 37, the balance heuristic Eq. 36, :math:`1/C`, or
        :math:`\\delta_{nc}` (the RA reduction; needs ``C = N``).
    beta : float
        Coefficient of the query-specific correction (1, Eq. 9).
    r_axis : {"query", "landmark"}
        Normalisation axis of :math:`r'` (the printed Eq. 37 is ambiguous).
    negative_weights : {"clamp", "signed"}
        Policy for :math:`\\alpha < 0`: clamp at :math:`10^{-8}` (default, the released
        code) or exact signed arithmetic.
    antithetic : bool
        Pairs :math:`\\mu_c \\pm \\epsilon_c` (2C samples).
    landmark_projection : bool
        Learned FC + LayerNorm on the query and key landmarks, shared across heads
        (needs ``head_dim``).
    head_dim : int, optional
    noise_std : {"paper", "code"} or float
        Noise scale of the draws (``"code"``: :math:`d^{-1/4}` as in the released code,
        whose density ratio still assumes unit variance).
    seed : int, optional
        Seed of the training draws (call ``r`` uses draw ``r``); ``None`` takes one at
        construction (agreed across ranks).
    generator : torch.Generator, optional
        Explicit source of the training draws instead of the seeded schedule.
    scale : float, optional

    Notes
    -----
    Consistent, not unbiased (AT002, ``biased_at_finite_budget=True``). Reductions
    checked to 1e-12 in float64: standard-normal proposals with constant weights give
    ``rfa-snis`` on the same samples; ``C = N``, the exact targets (``eq32``) and
    delta weights give ``ra`` with ``S = 1`` on the same samples.
    """

    name: ClassVar[str] = "lara"
    aliases: ClassVar[tuple[str, ...]] = ("linear-randomized-attention",)
    unbiased: ClassVar[bool] = False
    consistent: ClassVar[bool] = True
    supports_causal: ClassVar[bool] = False
    random: ClassVar[bool] = True
    has_budget: ClassVar[bool] = True
    linear: ClassVar[bool] = True
    default_num_features: ClassVar[int] = 16
    claims: ClassVar[tuple[Any, ...]] = CONSISTENCY_CLAIMS["lara"]

    def __init__(
        self,
        num_features: int | None = None,
        *,
        landmarks: str = "segment",
        grid: tuple[int, int] | None = None,
        pool: tuple[int, int] | None = None,
        proposal: str = "eq34",
        weighting: str = "decoupled",
        beta: float = 1.0,
        r_axis: str = "query",
        negative_weights: str = "clamp",
        antithetic: bool = False,
        landmark_projection: bool = False,
        head_dim: int | None = None,
        noise_std: float | str = "paper",
        seed: int | None = None,
        generator: torch.Generator | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__(scale=scale)
        self.num_features = check_positive_int(
            "num_features", self.default_num_features if num_features is None else num_features
        )
        self.landmarks = check_choice("landmarks", landmarks, ("segment", "pool2d"))
        for name, pair in (("grid", grid), ("pool", pool)):
            if pair is not None and not _positive_pair(pair):
                raise InputError(f"{name}: expected a pair of integers >= 1 (height, width), got {pair!r}")
        if landmarks == "pool2d":
            if grid is None:
                raise InputError(f"grid: landmarks='pool2d' needs the token grid (height, width), got {grid!r}")
            if pool is None:
                r = math.isqrt(self.num_features)
                if r * r != self.num_features:
                    raise InputError(
                        f"pool: num_features = {self.num_features} is not a square; give pool=(ph, pw) with ph*pw = C"
                    )
                pool = (r, r)
            if pool[0] * pool[1] != self.num_features:
                raise InputError(f"pool: expected ph * pw = num_features = {self.num_features}, got {pool!r}")
        self.grid = tuple(grid) if grid is not None else None
        self.pool = tuple(pool) if pool is not None else None
        self.proposal = check_choice("proposal", proposal, PROPOSALS)
        self.weighting = check_choice("weighting", weighting, WEIGHTINGS)
        if isinstance(beta, bool) or not isinstance(beta, int | float) or not math.isfinite(beta):
            raise InputError(f"beta: expected a finite number, got {beta!r}")
        self.beta = float(beta)
        self.r_axis = check_choice("r_axis", r_axis, R_AXES)
        self.negative_weights = check_choice("negative_weights", negative_weights, NEGATIVE_POLICIES)
        self.antithetic = _check_bool("antithetic", antithetic)
        self.noise_std = _check_noise(noise_std)
        self.draws = _Draws(seed, generator)
        self.q_proj: nn.Module | None = None
        self.k_proj: nn.Module | None = None
        if _check_bool("landmark_projection", landmark_projection):
            if head_dim is None:
                raise InputError("head_dim: landmark_projection=True needs head_dim (the projections are learned)")
            d = check_positive_int("head_dim", head_dim)
            self.q_proj = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d))
            self.k_proj = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d))

    def landmarks_of(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        q_keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query and key landmarks ``[B, H, C', d]`` and the kept key landmarks ``[B or 1, C']``.

        ``q_keep [B, H, N]`` leaves queries (non-finite ones) out of the query landmarks."""
        keep = None if key_padding_mask is None else ~key_padding_mask
        if self.landmarks == "pool2d":
            assert self.grid is not None and self.pool is not None
            q_land, _ = pooled_means(q, self.grid, self.pool, q_keep)
            k_land, ok = pooled_means(k, self.grid, self.pool, keep)
        else:
            c = min(self.num_features, q.shape[-2], k.shape[-2])
            q_land, _ = segment_means(q, c, q_keep)
            k_land, ok = segment_means(k, c, keep)
        if self.q_proj is not None and self.k_proj is not None:
            q_land, k_land = self.q_proj(q_land), self.k_proj(k_land)
        return q_land, k_land, ok

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        self.last_backend = "torch"
        dtype = compute_dtype(q.dtype)
        q, k, v32 = q.to(dtype), k.to(dtype), v.to(dtype)
        k, v32 = fn.drop_padded(k, v32, key_padding_mask)
        # a non-finite query leaves every statistic shared by the rows (landmarks, r'):
        # it can only make its own row non-finite
        q_keep = finite_rows(q)  # [B, H, N]
        if key_padding_mask is not None and q.shape[-2] == k.shape[-2]:
            # self-attention: the query at a padded position is padding too, so whatever it
            # holds shapes no statistic shared by the rows (landmarks, proposals, r')
            q_keep = q_keep & ~key_padding_mask[:, None, :]
        q_keep = None if bool(q_keep.all()) else q_keep
        # then non-finite rows are kept out of every product (their gradients would be
        # 0 * NaN) and the rows that see them set to NaN at the end (every row sees a key)
        allowed = allowed_pairs(q.shape[2], k.shape[2], False, key_padding_mask, q.device)
        q, k, v32, poison = quarantine_non_finite(q, k, v32, allowed)
        q_land, k_land, ok = self.landmarks_of(q, k, key_padding_mask, q_keep)
        props = make_proposals(self.proposal, q_land, k_land, k, key_padding_mask, ok)
        if self.training:
            omega, owner = props.sample(
                fn.noise_std_value(self.noise_std, q.shape[-1]), self.draws.next(), self.antithetic
            )
        else:
            omega = props.expected()  # [B, H, C, d]
            owner = torch.arange(omega.shape[-2], device=q.device)
        out = lara_from_samples(
            q,
            k,
            v32,
            omega,
            owner,
            props,
            weighting=self.weighting,
            q_land=q_land,
            beta=self.beta,
            r_axis=self.r_axis,
            negative_weights=self.negative_weights,
            key_padding_mask=key_padding_mask,
            q_keep=q_keep,
        )
        return poison_rows(out, poison).to(v.dtype)

    def extra_repr(self) -> str:
        return (
            f"num_features={self.num_features}, landmarks={self.landmarks!r}, proposal={self.proposal!r}, "
            f"weighting={self.weighting!r}, beta={self.beta}, negative_weights={self.negative_weights!r}"
        )


def _positive_pair(value: object) -> bool:
    """Whether ``value`` is a pair (tuple or list) of integers >= 1 (bools refused)."""
    return (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in value)
    )
