"""RFA-Gate (Peng et al., 2021, §3.2): causal random feature attention with a learned
forget gate.

.. math::
    g_t = \\sigma(w^\\top k_t + b), \\qquad
    S_t = g_t S_{t-1} + (1 - g_t)\\, \\phi(k_t) v_t^\\top, \\qquad
    z_t = g_t z_{t-1} + (1 - g_t)\\, \\phi(k_t), \\qquad
    \\mathrm{out}_t = \\frac{\\phi(q_t)^\\top S_t}{\\phi(q_t)^\\top z_t},

(:math:`S_0 = 0`, :math:`z_0 = 0`): recent tokens weigh more, a recency bias the
paper adds for language modelling. Unrolled,
:math:`S_t = \\sum_{j \\le t} (1 - g_j) e^{G_t - G_j} \\phi(k_j) v_j^\\top` with
:math:`G_t = \\sum_{i \\le t} \\log g_i`.

The gate is computed from the key here (one weight vector and bias per head); Peng
et al. compute it from the layer input :math:`x_t`, of which :math:`k_t` is a linear
image, so the family of gates is the same up to the key projection.

* :func:`gated_sums` is the fast form (numerator and denominator, divided by the
  estimator's normaliser): the engine's causal recurrence
  (:func:`~kernelattn_core.engine.chunked.causal_linear_attention`, published in the
  toolkit) with :math:`\\log g_t` as its per-position log-decay, key features
  :math:`(1 - g_t)\\phi(k_t)` and a column of ones appended to the values (its last output
  column is the denominator). Chunks of ``chunk_size`` positions, decays
  :math:`e^{G_t - G_j} \\le 1` inside a chunk and across chunks in the state scan, every
  exponent :math:`\\le 0` however long the sequence; time :math:`O(N C D d_v)`, its own
  backward (gradients of the features, the values and the gate), no loop recorded by
  autograd.
  :func:`gated_attention` divides it with a sign-keeping floor.
* :func:`gated_sums_naive` / :func:`gated_attention_naive` are the recurrence above, one
  position at a time (the references the tests compare with, outputs and gradients).
* :class:`Gate` is the per-head gate; the registered estimator is ``rfa-gate``
  (:class:`~kernelattn_fourier.estimators.RFAGateAttention`), causal only.

Padded keys (``key_padding_mask``) are skipped: the gate is 1 and the update 0 there,
so the state passes through unchanged whatever the padded values are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernelattn_core.toolkit import InputError, causal_linear_attention, check_positive_int, finite_rows


def _guard(den: torch.Tensor, eps: float) -> torch.Tensor:
    """Denominator with magnitude at least ``eps``, sign kept (signed trigonometric features)."""
    sign = torch.where(den < 0, -torch.ones_like(den), torch.ones_like(den))
    return sign * den.abs().clamp_min(eps)


def _skipped(log_g: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, H, N]`` (or broadcastable) bool: positions that leave the state unchanged."""
    if key_padding_mask is None:
        return None
    if key_padding_mask.dim() == 2:
        return key_padding_mask[:, None, :]  # [B, 1, N]
    return key_padding_mask  # [B, H, N]


def _gates(log_g: torch.Tensor, skip: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log g, 1 - g)`` with skipped positions set to ``g = 1`` (no forgetting, no update)."""
    if skip is None:
        return log_g, -torch.expm1(log_g)
    log_g = log_g.masked_fill(skip, 0.0)
    return log_g, (-torch.expm1(log_g)).masked_fill(skip, 0.0)


@dataclass
class GateState:
    """What RFA-Gate carries from one call to the next (decoding with
    :meth:`~kernelattn_fourier.estimators.RFAGateAttention.step`).

    Attributes
    ----------
    kv : Tensor ``[B, H, D, dv + 1]``
        :math:`[S_t, z_t]`: the gated sums over every position seen so far (the last
        column is :math:`z_t`). Differentiable.
    length : int
        Positions consumed.
    poisoned : Tensor ``[B, H]`` of bool, optional
        A non-finite key, value or gate was consumed: every later row is NaN.
    owner : StateOwner, optional
        The estimator, options, batch, heads and widths that made it (set by
        :meth:`~kernelattn_fourier.estimators.RFAGateAttention.step`, which refuses a
        state of another owner).
    """

    kv: torch.Tensor
    length: int
    poisoned: torch.Tensor | None = None
    owner: Any = None


def gated_sums(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator :math:`\\phi(q_t)^\\top S_t` and denominator :math:`\\phi(q_t)^\\top z_t`
    of RFA-Gate (fast, chunked; no loop recorded by autograd).

    .. math::
        \\phi(q_t)^\\top S_t = \\sum_{j \\le t} (1 - g_j)\\, e^{G_t - G_j}\\,
        \\phi(q_t)^\\top \\phi(k_j)\\, v_j^\\top, \\qquad G_t = \\sum_{i \\le t} \\log g_i .

    Inside a chunk of :math:`C` positions the decays :math:`e^{G_t - G_j}` (:math:`j \\le t`)
    form a :math:`C \\times C` matrix; the state carried from chunk to chunk is decayed by
    :math:`e^{G_{\\text{end}} - G_{\\text{start}}}`. Every exponent is :math:`\\le 0`.

    **Non-finite inputs.** One reduction checks that keys, values and gates are finite.
    When some are not, the offending positions are removed from the products like padding
    (so a ``0 * NaN`` inside a chunk cannot reach an earlier row) and the rows that see
    them (``t >= j``) are set to NaN afterwards, as the recurrence gives them; earlier
    rows are exactly those of the finite inputs.

    Parameters
    ----------
    phi_q, phi_k : Tensor ``[B, H, N, D]``
        Query and key features.
    v : Tensor ``[B, H, N, dv]``
    log_g : Tensor ``[B, H, N]``
        :math:`\\log g_t \\le 0` (``logsigmoid`` of the gate logits).
    key_padding_mask : Tensor ``[B, N]`` (bool, ``True`` = padded), optional
        Padded positions keep the state unchanged (:math:`g = 1`, no update).
    chunk_size : int

    Returns
    -------
    num : Tensor ``[B, H, N, dv]``
    den : Tensor ``[B, H, N]``
    """
    num, den, _ = gated_sums_state(
        phi_q, phi_k, v, log_g, key_padding_mask=key_padding_mask, chunk_size=chunk_size, state=None
    )
    return num, den


def gated_sums_state(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    chunk_size: int = 64,
    state: GateState | None = None,
) -> tuple[torch.Tensor, torch.Tensor, GateState]:
    """:func:`gated_sums` continuing from ``state`` (the earlier positions; ``None``
    starts a sequence), also returning the state after the last position: calls over
    consecutive pieces of a sequence give the rows of one call over all of it."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InputError(f"chunk_size: expected an integer >= 1, got {chunk_size!r}")
    b, h, n, d_feat = phi_q.shape
    dv = v.shape[-1]
    if state is not None and tuple(state.kv.shape) != (b, h, d_feat, dv + 1):
        raise InputError(
            f"state: expected a GateState of kv shape {(b, h, d_feat, dv + 1)} (B, H, D, dv + 1) for these "
            f"inputs, got {tuple(state.kv.shape)}"
        )
    s0 = phi_q.new_zeros(b, h, d_feat, dv + 1) if state is None else state.kv.to(phi_q.dtype)
    carried = None if state is None else state.poisoned
    length = (0 if state is None else state.length) + n
    if n == 0:
        return phi_q.new_zeros(b, h, 0, dv), phi_q.new_zeros(b, h, 0), GateState(s0, length, carried)
    skip = _skipped(log_g, key_padding_mask)
    poison = None
    # one reduction decides whether the rows must be scanned: a NaN or an infinity anywhere
    # makes the sum non-finite (so does an overflowing sum of finite values: then the scan
    # below finds nothing); the elementwise scans cost as much as the recurrence's products
    total = phi_q.detach().sum() + phi_k.detach().sum() + v.detach().sum() + log_g.detach().sum()
    if not bool(torch.isfinite(total)):
        bad = ~(finite_rows(phi_k) & finite_rows(v) & torch.isfinite(log_g))  # [B, H, N]
        if skip is not None:
            bad = bad & ~skip
        if bool(bad.any()):
            poison = bad.cumsum(-1) > 0  # [B, H, N]: rows at or after a non-finite position
            skip = bad if skip is None else skip | bad
            carried = bad.any(-1) if carried is None else carried | bad.any(-1)
        bad_q = ~finite_rows(phi_q)  # [B, H, N]: a non-finite query spoils its own row only
        if bool(bad_q.any()):
            phi_q = phi_q.masked_fill(bad_q.unsqueeze(-1), 0.0)  # kept out of the products (and gradients)
            poison = bad_q if poison is None else poison | bad_q
    if state is not None and state.poisoned is not None:  # consumed by an earlier call
        earlier = state.poisoned[..., None].expand(b, h, n)
        poison = earlier if poison is None else poison | earlier
    log_g, upd = _gates(log_g, skip)  # padded and non-finite positions: g = 1 (log 0), no update
    if bool((log_g.detach() > 0).any()):
        raise InputError(f"log_g: expected values <= 0 (log of a gate in (0, 1]), got {log_g.detach().max().item()!r}")
    fk = phi_k * upd.unsqueeze(-1)  # [B, H, N, D]: (1 - g_j) phi(k_j)
    if skip is not None:
        fk = fk.masked_fill(skip.unsqueeze(-1), 0.0)
        v = v.masked_fill(skip.unsqueeze(-1), 0.0)
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # [B, H, N, dv + 1]: z is the last column
    # the engine's causal recurrence with the gate as its decay: S_t = g_t S_{t-1} + fk_t v1_t^T
    out, s_final = causal_linear_attention(phi_q, fk, v1, s0, None, None, chunk_size, log_g.expand(b, h, n))
    num, den = out.split([dv, 1], dim=-1)
    den = den.squeeze(-1)
    if poison is not None:
        num = num.masked_fill(poison.unsqueeze(-1), float("nan"))
        den = den.masked_fill(poison, float("nan"))
    return num, den, GateState(s_final, length, carried)


def gated_step_finite(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    state: GateState,
    normalize: Any,
) -> tuple[torch.Tensor, GateState] | None:
    """One decoding position of RFA-Gate on the assumption that every value is finite, or
    ``None`` when it fails (the caller then runs :func:`gated_sums_state`, whose result
    this equals up to rounding wherever it returns):

    .. math::
        [S_t, z_t] = g_t\\,[S_{t-1}, z_{t-1}] + (1 - g_t)\\,\\phi(k_t)\\,[v_t, 1]^\\top, \\qquad
        \\mathrm{out}_t = \\mathrm{normalize}(\\phi(q_t)^\\top S_t,\\ \\phi(q_t)^\\top z_t),

    about fifteen tensor operations and one read-back (the row and the state finite)
    where the chunked scan spends about a hundred on one position.

    Parameters
    ----------
    phi_q, phi_k : Tensor ``[B, H, 1, D]``
    v : Tensor ``[B, H, 1, dv]``
    log_g : Tensor ``[B, H, 1]``
        :math:`\\log g_t` (``logsigmoid`` of the gate logits).
    state : GateState
        Not poisoned, ``kv`` of the inputs' dtype.
    normalize : callable
        The estimator's ``normalizer.normalize`` (``num [B, H, 1, dv]``, ``den [B, H, 1]``).
    """
    dv = v.shape[-1]
    g, upd = log_g.exp(), -torch.expm1(log_g)  # [B, H, 1]
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # [B, H, 1, dv + 1]
    kv = torch.addcmul(state.kv * g.unsqueeze(-1), (phi_k * upd.unsqueeze(-1)).mT, v1)  # [B, H, D, dv + 1]
    out = phi_q @ kv  # [B, H, 1, dv + 1]
    row = normalize(out[..., :dv], out[..., dv])
    if not math.isfinite(float(row.sum() + kv.sum())):  # a non-finite q, k, v or gate reaches one of them
        return None
    return row, GateState(kv, state.length + 1, None, state.owner)


def gated_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    chunk_size: int = 64,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Causal gated feature attention (fast, chunked): :func:`gated_sums` divided with a
    sign-keeping floor ``eps`` on the denominator's magnitude.

    Parameters
    ----------
    phi_q, phi_k : Tensor ``[B, H, N, D]``
        Query and key features.
    v : Tensor ``[B, H, N, dv]``
    log_g : Tensor ``[B, H, N]``
        :math:`\\log g_t \\le 0` (``logsigmoid`` of the gate logits).
    key_padding_mask : Tensor ``[B, N]`` (bool, ``True`` = padded), optional
    chunk_size : int
    eps : float
        Smallest denominator magnitude.

    Returns
    -------
    Tensor ``[B, H, N, dv]``
    """
    num, den = gated_sums(phi_q, phi_k, v, log_g, key_padding_mask=key_padding_mask, chunk_size=chunk_size)
    return num / _guard(den, eps).unsqueeze(-1)


def gated_sums_naive(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of RFA-Gate, one position at a time (the reference for tests):
    :math:`S_t = g_t S_{t-1} + (1 - g_t)\\phi(k_t) v_t^\\top`,
    :math:`z_t = g_t z_{t-1} + (1 - g_t)\\phi(k_t)`, returning
    :math:`(\\phi(q_t)^\\top S_t, \\phi(q_t)^\\top z_t)` ``[B, H, N, dv]``, ``[B, H, N]``.
    A padded position keeps the state: :math:`S_t = S_{t-1}`."""
    b, h, n, d_feat = phi_q.shape
    s = phi_q.new_zeros(b, h, d_feat, v.shape[-1])
    z = phi_q.new_zeros(b, h, d_feat)
    nums, dens = [], []
    for t in range(n):
        g_t = log_g[:, :, t].exp()  # [B, H]
        s_new = g_t[..., None, None] * s + (1 - g_t)[..., None, None] * phi_k[:, :, t, :, None] * v[:, :, t, None, :]
        z_new = g_t[..., None] * z + (1 - g_t)[..., None] * phi_k[:, :, t]
        if key_padding_mask is not None:
            keep = ~key_padding_mask[:, t, None]  # [B, 1]
            s = torch.where(keep[..., None, None], s_new, s)
            z = torch.where(keep[..., None], z_new, z)
        else:
            s, z = s_new, z_new
        nums.append((phi_q[:, :, t].unsqueeze(-2) @ s).squeeze(-2))  # [B, H, dv]
        dens.append((phi_q[:, :, t] * z).sum(-1))  # [B, H]
    return torch.stack(nums, dim=2), torch.stack(dens, dim=2)


def gated_attention_naive(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """:func:`gated_sums_naive` divided as :func:`gated_attention` divides (reference for tests)."""
    num, den = gated_sums_naive(phi_q, phi_k, v, log_g, key_padding_mask=key_padding_mask)
    return num / _guard(den, eps).unsqueeze(-1)


class Gate(nn.Module):
    """Per-head forget gate :math:`\\log g_t = \\log\\sigma(w_h^\\top k_t + b_h)`.

    Parameters
    ----------
    head_dim : int, optional
        :math:`d`; when ``None`` the weight is made on the first call (zeros, so the
        gate starts at the constant :math:`\\sigma(b_h)` whatever ``d``), or from a loaded
        state dict. Pass it to have the weight before an optimiser is made.
    num_heads : int, optional
        One gate per head (inputs ``[B, H, N, d]`` with ``H = num_heads``); one gate
        shared by every head when ``None``.
    init_bias : float
        Initial :math:`b_h` (2.0 by default: :math:`g \\approx 0.88`, slow forgetting).

    Attributes
    ----------
    weight : Parameter ``[H, d]`` (``[1, d]`` when shared; ``[H, 0]`` until built)
    bias : Parameter ``[H]`` (``[1]`` when shared)
    """

    def __init__(self, head_dim: int | None = None, num_heads: int | None = None, init_bias: float = 2.0) -> None:
        super().__init__()
        if num_heads is not None and (isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1):
            raise InputError(f"num_heads: expected a positive integer or None, got {num_heads!r}")
        if isinstance(init_bias, bool) or not isinstance(init_bias, int | float) or not math.isfinite(init_bias):
            raise InputError(f"init_gate_bias (the gate's init_bias): expected a finite number, got {init_bias!r}")
        self.num_heads = num_heads
        rows = num_heads or 1
        self.weight = nn.Parameter(torch.zeros(rows, 0))
        self.bias = nn.Parameter(torch.full((rows,), float(init_bias)))
        self.register_load_state_dict_pre_hook(_build_gate_before_load)
        if head_dim is not None:
            self.build(head_dim)

    @property
    def head_dim(self) -> int | None:
        """:math:`d` once built, else ``None``."""
        return self.weight.shape[1] or None

    def build(self, head_dim: int) -> None:
        """Make the weight ``[H, head_dim]`` (zeros); a built gate refuses another ``d``."""
        head_dim = check_positive_int("head_dim", head_dim)
        if self.head_dim is not None:
            if head_dim != self.head_dim:
                raise InputError(f"head_dim: the rfa-gate gate was built for d = {self.head_dim}, got d = {head_dim}")
            return
        like = self.bias
        self.weight = nn.Parameter(torch.zeros(like.shape[0], head_dim, dtype=like.dtype, device=like.device))

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        """``k [B, H, N, d]`` to ``log g [B, H, N]``."""
        if self.num_heads is not None and k.shape[1] != self.num_heads:
            raise InputError(
                f"num_heads: the gate was built with num_heads = {self.num_heads}, got inputs with H = {k.shape[1]}"
            )
        self.build(k.shape[-1])
        w = self.weight.to(k.dtype)[None, :, None, :]  # [1, H or 1, 1, d]
        logits = (k * w).sum(-1) + self.bias.to(k.dtype)[None, :, None]  # [B, H, N]
        return nn.functional.logsigmoid(logits)


def _build_gate_before_load(module: Gate, state_dict: dict, prefix: str, *args: object) -> None:
    """Load-state-dict pre-hook: an unbuilt gate takes the saved weight's shape first."""
    saved = state_dict.get(prefix + "weight")
    if module.head_dim is None and isinstance(saved, torch.Tensor) and saved.dim() == 2 and saved.shape[1] > 0:
        module.build(int(saved.shape[1]))
