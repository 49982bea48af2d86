"""Symbolic and Monte Carlo checks of the theory: Lemma A.1, the corrected optimal
weights (Eq. 27) and Eq. 35, MIS unbiasedness with the exact target (negative weights
included), and sum-to-one at a common omega (E5)."""

from __future__ import annotations

import math

import sympy as sp
import torch
from kernelattn_sampling.lara import Proposals, r_prime, weight_table
from kernelattn_sampling.theory import derive_lemma_a1_1d, eq35_printed_collapses, lemma_a1_vector, optimal_weights

from kernelattn_core.toolkit import z_threshold

D64 = torch.float64


def test_sampling_lemma_a1_symbolic_1d_and_3d() -> None:
    lhs, rhs, _ = derive_lemma_a1_1d()
    assert sp.simplify(lhs - rhs) == 0
    assert lemma_a1_vector(3) == 0
    # negative control: a wrong mean (q - k) does not simplify to zero
    _w, _q, k = sp.symbols("omega q k", real=True)
    assert sp.simplify(lhs - rhs.subs(k, -k)) != 0


def test_sampling_corrected_optimal_weights_sum_to_one_and_printed_do_not() -> None:
    """Erratum A7 (Eq. 27): with r_{nc'} inside the sum and no extra division, sum_c alpha*_c = 1."""
    qs = sp.symbols("q1:4", positive=True)
    rs = sp.symbols("r1:4", real=True)
    assert sp.simplify(sum(optimal_weights(list(qs), list(rs), corrected=True)) - 1) == 0
    assert sp.simplify(sum(optimal_weights(list(qs), list(rs), corrected=False)) - 1) != 0


def test_sampling_eq35_as_printed_collapses_to_eq34() -> None:
    """Erratum A5: the printed Eq. 35 averages k_c with weights summing to one, i.e. Eq. 34."""
    assert eq35_printed_collapses() == 0


def _toy(seed=0, n=3, m=4, c=3, d=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, n, d, generator=g, dtype=D64) * 0.8
    k = torch.randn(1, 1, m, d, generator=g, dtype=D64) * 0.8
    v = torch.randn(1, 1, m, 2, generator=g, dtype=D64)
    q_land = torch.randn(1, 1, c, d, generator=g, dtype=D64) * 0.8
    mu = q_land + torch.randn(1, 1, c, d, generator=g, dtype=D64) * 0.5
    return q, k, v, q_land, Proposals(mu)


def _log_target(omega: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """log p_n(omega) ``[R, C, N]`` of the exact targets (Eq. 5) at ``omega [R, C, d]``."""
    logpi = torch.log_softmax(q[0, 0] @ k[0, 0].T, -1)  # [N, M]
    means = q[0, 0][:, None, :] + k[0, 0][None, :, :]  # [N, M, d]
    sq = ((omega[:, :, None, None, :] - means) ** 2).sum(-1)  # [R, C, N, M]
    d = omega.shape[-1]
    return torch.logsumexp(logpi - 0.5 * sq, -1) - 0.5 * d * math.log(2 * math.pi)


def _mis_draws(weighting: str, beta: float, centred: bool = True, redraws: int = 40000, seed: int = 1):
    """Unnormalised MIS (App. F) with the exact targets: ``[R, N, dv]`` and the weights."""
    q, k, v, q_land, props = _toy()
    c, d = props.count, q.shape[-1]
    g = torch.Generator().manual_seed(seed)
    omega = props.mean[0, 0] + torch.randn(redraws, c, d, generator=g, dtype=D64)  # [R, C, d]: one per proposal
    lr = props.log_ratio(omega[:, None])  # [R, 1, C(sample), C(proposal)]
    rp = r_prime(q, q_land)  # [1, 1, N, C]
    alpha = weight_table(weighting, lr, omega[:, None], rp, beta=beta)[:, 0]  # [R, N, S, C]
    if not centred:  # a defect: the correction no longer sums to zero over c
        alpha = alpha + beta * rp[0, 0][None, :, None, :] * 0.5
    a = alpha.diagonal(dim1=-2, dim2=-1)  # [R, N, C]: alpha_{n c}(omega_c)
    log_q = lr.diagonal(dim1=-2, dim2=-1)[:, 0] - 0.5 * (omega**2).sum(-1) - 0.5 * d * math.log(2 * math.pi)
    log_p = _log_target(omega, q, k)  # [R, C, N]
    ratio = (log_p - log_q[..., None]).exp().permute(0, 2, 1)  # [R, N, C]
    logits = omega @ k[0, 0].T - 0.5 * (k[0, 0] ** 2).sum(-1)  # [R, C, M]
    f = torch.softmax(logits, -1) @ v[0, 0]  # [R, C, dv]
    est = torch.einsum("rnc,rcd->rnd", a * ratio, f)
    exact = torch.softmax(q[0, 0] @ k[0, 0].T, -1) @ v[0, 0]
    return est, exact, a


def _max_z(est: torch.Tensor, exact: torch.Tensor) -> float:
    se = est.std(0) / math.sqrt(est.shape[0])
    return float(((est.mean(0) - exact) / se).abs().max())


def test_sampling_mis_with_exact_target_is_unbiased_with_negative_weights() -> None:
    """N5: unnormalised MIS with Eq. 38 weights (beta = 2; some alpha < 0) is unbiased."""
    est, exact, a = _mis_draws("decoupled", beta=2.0)
    frac_neg = float((a < 0).double().mean())
    z = _max_z(est, exact)
    print("MIS decoupled beta=2: max |z|", round(z, 2), "negative weights", frac_neg)
    assert frac_neg > 0.001
    assert z < z_threshold(exact.numel())
    for kind in ("balance", "coupled"):
        est, exact, _ = _mis_draws(kind, beta=1.0, redraws=20000, seed=3)
        assert _max_z(est, exact) < z_threshold(exact.numel()), kind


def test_sampling_mis_negative_control_weights_not_summing_to_one_are_biased() -> None:
    est, exact, _ = _mis_draws("decoupled", beta=2.0, centred=False)
    z = _max_z(est, exact)
    print("MIS control max |z|", round(z, 2))
    assert z > 2 * z_threshold(exact.numel())


def test_sampling_weights_sum_to_one_at_a_common_omega_but_not_when_realised() -> None:
    """E5: sum_c alpha_nc(omega) = 1 at any common omega for every weighting; the realised
    weights alpha_nc(omega_c) at distinct points do not sum to one."""
    q, _k, _v, q_land, props = _toy(n=3, c=3)
    omega = torch.randn(1, 1, 50, 2, generator=torch.Generator().manual_seed(5), dtype=D64) * 2
    lr, rp = props.log_ratio(omega), r_prime(q, q_land)
    for kind in ("constant", "balance", "coupled", "decoupled", "delta"):
        table = weight_table(kind, lr, omega, rp, beta=2.0)  # [1, 1, N, P, C]
        assert float((table.sum(-1) - 1).abs().max()) < 1e-12, kind
    realised = weight_table("balance", lr[:, :, :3], omega[:, :, :3], rp)[0, 0].diagonal(dim1=-2, dim2=-1)
    assert float((realised.sum(-1) - 1).abs().max()) > 1e-3
