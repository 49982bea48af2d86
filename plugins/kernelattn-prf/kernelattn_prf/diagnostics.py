"""Monte Carlo diagnostics: the single-:math:`\\omega` estimates a built map averages.

For a map with :math:`m` random vectors the kernel estimate is
:math:`\\widehat{\\mathrm{SM}} = \\frac1m \\sum_i s_i`, where :math:`s_i` is the unbiased
estimate made by :math:`\\omega_i` alone (:math:`s_i = e^{\\omega_i^\\top z - (\\|x'\\|^2+\\|y'\\|^2)/2}`,
or its :math:`\\cosh` form for two-sided maps). With iid rows the :math:`s_i` are iid, so
one map with many rows gives many independent draws at once.
"""

from __future__ import annotations

import torch

from .feature_maps import PositiveRandomFeatures


def per_omega_estimates(fm: PositiveRandomFeatures, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Single-:math:`\\omega` estimates :math:`s_i(x_j, y_j)` for paired rows ``x, y [n, d]``: ``[n, m]``.

    Exponents are combined before ``exp`` (exact for any norms that do not overflow
    the final value).
    """
    lq, lk = fm.query_log(x), fm.key_log(y)  # [n, D]
    terms = (lq + lk).exp() * fm.feature_dim  # [n, D]: D * phi_q phi_k
    m = fm.num_features
    if fm.two_sided:
        return 0.5 * (terms[..., :m] + terms[..., m:])  # [n, m]
    return terms


def grouped_estimates(single: torch.Tensor, group: int) -> torch.Tensor:
    """Estimates of maps with ``group`` random vectors each: means of consecutive groups of
    the columns of ``single [n, m]``, giving ``[n, m // group]`` (a trailing remainder is dropped)."""
    n, m = single.shape
    g = m // group
    return single[:, : g * group].reshape(n, g, group).mean(-1)
