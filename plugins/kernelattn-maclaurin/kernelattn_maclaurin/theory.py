"""The theorems of Macformer / SchoenbAt as executable statements, with their defects.

* :func:`theorem2_bound` and :func:`required_features`: the Hoeffding-type bound of
  Theorem 2, :math:`P(|\\mathrm{RMFA} - \\mathrm{attn}| > \\varepsilon) \\le
  2D\\exp(-D\\varepsilon^2 / (2L^2))`, as a calculator (spec 001 §6.2, test D5). The
  proof is invalid (the premise fails, RMFA is no average of single-feature ratios,
  the factor :math:`D` is unmotivated); the calculator shows how weak the bound is even
  taken at face value: at the papers' :math:`D = 128` it is vacuous for
  :math:`\\varepsilon \\le 0.25`.
* :func:`premise_violation_rate`: the premise of Theorem 2, :math:`|\\mathrm{RMFA}_{ij}|
  \\le L = \\max|V|`, fails with positive probability (signed features make the
  weights non-convex; test M6).
* :func:`theorem3_counterexample`: Theorem 3 ("ppSBN restores the scale") is not an
  identity: with :math:`V = \\mathbf 1` the left side is exactly 1 and the right side
  :math:`\\mathrm{Softmax}(\\mu_Q K^\\top/\\sqrt d)^{-1/r}` exceeds 1 (test D3).
"""

from __future__ import annotations

import math

import torch

from kernelattn_core.toolkit import InputError


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < math.inf):
        raise InputError(f"{name}: expected a finite number > 0, got {value!r}")
    return float(value)


def theorem2_bound(num_features: int, eps: float, bound: float = 1.0) -> float:
    """Right side of Theorem 2: :math:`2D \\exp(-D\\varepsilon^2 / (2L^2))`.

    Parameters
    ----------
    num_features : int
        :math:`D`.
    eps : float
        Deviation :math:`\\varepsilon > 0`.
    bound : float
        :math:`L \\ge \\max|V_{ij}|` (1 by default).

    Returns
    -------
    float
        The stated bound on :math:`P(|\\mathrm{RMFA}_{ij} - \\mathrm{attn}_{ij}| > \\varepsilon)`
        (values above 1 are vacuous).

    Examples
    --------
    >>> f"{theorem2_bound(128, 0.5):.3g}"
    '2.88e-05'
    """
    if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
        raise InputError(f"num_features: expected an integer >= 1, got {num_features!r}")
    eps, bound = _positive("eps", eps), _positive("bound", bound)
    return 2.0 * num_features * math.exp(-num_features * eps * eps / (2.0 * bound * bound))


def required_features(eps: float, delta: float, bound: float = 1.0) -> int:
    """Smallest :math:`D` whose Theorem 2 bound is at most ``delta``.

    The bound :math:`2D e^{-D\\varepsilon^2/2L^2}` first grows (up to
    :math:`D = 2L^2/\\varepsilon^2`) and then falls; the answer is the first :math:`D`
    past the peak where it drops to ``delta`` (found by bisection on the falling side).

    Examples
    --------
    >>> required_features(0.1, 0.05)
    2285
    """
    eps, bound = _positive("eps", eps), _positive("bound", bound)
    delta = _positive("delta", delta)
    peak = max(1, math.floor(2.0 * bound * bound / (eps * eps)))
    if theorem2_bound(1, eps, bound) <= delta:
        return 1
    lo, hi = peak, max(peak, 2)
    while theorem2_bound(hi, eps, bound) > delta:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # invariant: bound(lo) > delta >= bound(hi), on the falling side
        mid = (lo + hi) // 2
        if theorem2_bound(mid, eps, bound) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def premise_violation_rate(
    dim: int = 4,
    seq_len: int = 8,
    num_features: int = 2,
    trials: int = 2000,
    *,
    kernel: str = "exp",
    seed: int = 0,
) -> float:
    """Fraction of RMFA output entries with :math:`|\\mathrm{RMFA}_{ij}| > L = \\max|V|`
    (the premise of Theorem 2), over ``trials`` independent draws.

    Inputs: :math:`Q, K` rows uniform on the unit sphere scaled into :math:`\\ell_2(0, 1)`
    (norms 0.9), :math:`V \\sim U(-1, 1)^{N \\times d}`; RMFA is
    :math:`\\Phi(Q)\\Phi(K)^\\top V / \\Phi(Q)\\Phi(K)^\\top\\mathbf 1` with paper-form random
    Maclaurin features. A convex combination of the :math:`V` rows never exceeds
    :math:`L`; any positive rate shows the premise false.
    """
    from .feature_maps import RandomMaclaurinFeatures

    g = torch.Generator().manual_seed(seed)
    over, total = 0, 0
    for _ in range(trials):
        q = torch.nn.functional.normalize(torch.randn(seq_len, dim, generator=g, dtype=torch.float64), dim=-1) * 0.9
        k = torch.nn.functional.normalize(torch.randn(seq_len, dim, generator=g, dtype=torch.float64), dim=-1) * 0.9
        v = 2 * torch.rand(seq_len, dim, generator=g, dtype=torch.float64) - 1
        fm = RandomMaclaurinFeatures(head_dim=dim, num_features=num_features, kernel=kernel, generator=g).double()
        weights = fm.query(q) @ fm.key(k).T  # [N, N]
        out = (weights @ v) / (weights.sum(-1, keepdim=True))  # [N, d]
        limit = float(v.abs().max())
        finite = torch.isfinite(out)
        over += int(((out.abs() > limit) | ~finite).sum())
        total += out.numel()
    return over / total


def theorem3_counterexample(
    seq_len: int = 5, dim: int = 4, *, seed: int = 0, eps: float = 1e-12
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Both sides of Theorem 3 at :math:`V = \\mathbf 1` (exact softmax attention).

    Left: :math:`\\mathrm{Softmax}(Q^{SBN}K^{SBN\\top}/\\sqrt d)\\,\\mathbf 1 = \\mathbf 1` (a
    convex combination of ones). Right: :math:`\\frac1t\\,[\\mathrm{Softmax}(QK^\\top/\\sqrt d)
    \\mathbf 1]^{1/r} = \\mathrm{Softmax}(\\mu_Q K^\\top/\\sqrt d)^{-1/r}` with
    :math:`r = \\|Q\\|_2\\|K\\|_2\\sqrt{(\\sigma_Q + \\varepsilon)(\\sigma_K + \\varepsilon)}`
    and the pre-scaling :math:`(Q - \\mu_Q)/\\sqrt{\\sigma_Q + \\varepsilon}` (the spec's
    definitions, spec 001 §3.1: :math:`\\sigma` is a **variance**). Returns ``(left [N],
    right [N], r)``; the right side's entries exceed 1 whenever :math:`N \\ge 2`, so the
    "theorem" is no identity.
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, dim, generator=g, dtype=torch.float64)
    k = torch.randn(seq_len, dim, generator=g, dtype=torch.float64)
    v = torch.ones(seq_len, 1, dtype=torch.float64)
    mu_q, sigma_q = q.mean(), q.var()  # variances, as the spec defines sigma
    mu_k, sigma_k = k.mean(), k.var()
    qs, ks = (q - mu_q) / (sigma_q + eps).sqrt(), (k - mu_k) / (sigma_k + eps).sqrt()
    left = (torch.softmax(qs @ ks.T / math.sqrt(dim), dim=-1) @ v).squeeze(-1)  # [N]
    r = float(torch.linalg.matrix_norm(q, ord=2) * torch.linalg.matrix_norm(k, ord=2)) * math.sqrt(
        float((sigma_q + eps) * (sigma_k + eps))
    )
    mean_row = torch.full((1, dim), float(mu_q), dtype=torch.float64)
    right = torch.softmax(mean_row @ k.T / math.sqrt(dim), dim=-1).squeeze(0) ** (-1.0 / r)  # [N]
    return left, right, r


def nmse_by_budget(
    budgets: tuple[int, ...] = (16, 64, 256),
    *,
    n: int = 200,
    dim: int = 64,
    repeats: int = 4,
    seed: int = 0,
) -> dict[int, float]:
    """Mean NMSE :math:`\\|\\hat Y - Y\\|_F^2 / \\|Y\\|_F^2` of paper-form RMFA (``exp``)
    against exact kernelized attention on ppSBN-pre-scaled Gaussian inputs
    (:math:`Q, K, V \\sim N(0, 1)^{n \\times d}`; spec 001 §7, test M5), per budget ``D``.
    NMSE falls about as :math:`1/D`; at :math:`d = 64`, :math:`n = 1000`, :math:`D = 256`
    it is about 2-3e-4."""
    from .estimators import RMFA
    from .feature_maps import RandomMaclaurinFeatures
    from .naive import kernelized_attention_naive
    from .normalizers import PPSBN

    gen = torch.Generator().manual_seed(seed)
    data = [
        tuple(torch.randn(1, 1, n, dim, generator=gen, dtype=torch.float64) for _ in range(3)) for _ in range(repeats)
    ]
    pre = PPSBN(power=False)
    out: dict[int, float] = {}
    for budget in budgets:
        total = 0.0
        for r, (q, k, v) in enumerate(data):
            qs, ks = pre.pre(q, k)
            fm = RandomMaclaurinFeatures(num_features=budget, kernel="exp").double()
            fm.build(dim, generator=torch.Generator().manual_seed(10_007 * budget + r + 1000 * seed))
            ref = kernelized_attention_naive(qs, ks, v, fm.target.f)
            with torch.no_grad():
                est = RMFA(fm, PPSBN(power=False)).double()(q, k, v)
            total += float((est - ref).pow(2).sum() / ref.pow(2).sum())
        out[budget] = total / repeats
    return out


def loglog_slope(values: dict[int, float]) -> float:
    """Least-squares slope of :math:`\\log` value against :math:`\\log D`."""
    xs = [math.log(b) for b in values]
    ys = [math.log(v) for v in values.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
