"""Shared pieces of the spectral feature maps: option checks and the RKS / PRF forms."""

from __future__ import annotations

import math

import torch

from kernelattn_core.toolkit import InputError


def check_positive_float(name: str, value: object, *, allow_zero: bool = False) -> float:
    """A finite number ``> 0`` (``>= 0`` with ``allow_zero``), else :class:`InputError`."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok and (value > 0 or (allow_zero and value == 0)):
        return float(value)  # type: ignore[arg-type]
    want = "a finite number >= 0" if allow_zero else "a finite number > 0"
    raise InputError(f"{name}: expected {want}, got {value!r}")


def check_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def rks_features(u: torch.Tensor) -> torch.Tensor:
    """Trigonometric (RKS) features of projections ``u [..., m]``:

    .. math:: \\phi(x) = \\tfrac{1}{\\sqrt m}[\\cos u_1, \\dots, \\cos u_m, \\sin u_1, \\dots, \\sin u_m],
              \\quad u_i = \\omega_i^\\top x,

    so :math:`\\phi(x)^\\top \\phi(y) = \\frac1m \\sum_i \\cos(\\omega_i^\\top (x - y))`. ``[..., 2m]``.
    """
    return torch.cat((torch.cos(u), torch.sin(u)), dim=-1) / math.sqrt(u.shape[-1])


def prf_log_features(u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Log of positive (PRF) features of projections ``u [..., m]`` of ``x [..., d]``:

    .. math:: \\log \\phi_i(x) = \\omega_i^\\top x - \\tfrac12 \\|x\\|^2 - \\tfrac12 \\log m,

    so :math:`\\phi(q)^\\top \\phi(k) = \\frac1m \\sum_i e^{\\omega_i^\\top (q + k) - \\|q\\|^2/2 - \\|k\\|^2/2}`.
    """
    return u - 0.5 * x.pow(2).sum(-1, keepdim=True) - 0.5 * math.log(u.shape[-1])
