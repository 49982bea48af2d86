"""Fast Walsh–Hadamard transform, :math:`O(d \\log d)` per vector.

The transform multiplies by the unnormalised Sylvester–Hadamard matrix

.. math:: H_1 = [1], \\qquad H_{2n} = \\begin{bmatrix} H_n & H_n \\\\ H_n & -H_n \\end{bmatrix},
          \\qquad H_d H_d^\\top = d I,

along the last dimension. The explicit matrix is :func:`kernelattn_spectral.naive.hadamard_matrix`
(the reference the tests compare with).
"""

from __future__ import annotations

import torch

from kernelattn_core.toolkit import InputError


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is a positive power of two (1, 2, 4, ...)."""
    return n > 0 and (n & (n - 1)) == 0


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh–Hadamard transform :math:`x \\mapsto H_d x` of ``x [..., d]``.

    ``log2(d)`` butterfly stages, each one vectorised over every element (no Python
    loop over elements), so the cost is :math:`O(d \\log d)` per vector. Differentiable.

    Parameters
    ----------
    x : Tensor ``[..., d]`` with ``d`` a power of two.

    Returns
    -------
    Tensor ``[..., d]``: :math:`H_d x` (Sylvester ordering).
    """
    d = x.shape[-1]
    if not is_power_of_two(d):
        raise InputError(f"x: the Walsh–Hadamard transform needs a last dimension that is a power of two, got {d}")
    lead = x.shape[:-1]
    y = x
    h = 1
    while h < d:  # log2(d) stages
        y = y.reshape(*lead, d // (2 * h), 2, h)  # [..., blocks, 2, h]
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(*lead, d)
