"""Shift-invariant kernels with their spectral densities and frequency samplers.

By Bochner's theorem a continuous, positive-definite, shift-invariant kernel
:math:`K(x, y) = g(x - y)` with :math:`g(0) = 1` is the characteristic function of a
probability density :math:`p` (its *spectral density*):

.. math:: g(\\delta) = \\int_{\\mathbb{R}^d} p(\\omega)\\, e^{i \\omega^\\top \\delta}\\, d\\omega
          = \\mathbb{E}_{\\omega \\sim p}\\left[\\cos(\\omega^\\top \\delta)\\right],
          \\qquad
          p(\\omega) = (2\\pi)^{-d} \\int_{\\mathbb{R}^d} g(\\delta)\\, e^{-i \\omega^\\top \\delta}\\, d\\delta .

Each kernel here carries three views of :math:`p`: :meth:`~SpectralKernel.sample_frequencies`
(what random Fourier features draw), :meth:`~SpectralKernel.log_spectral_density`
(torch) and :meth:`~SpectralKernel.spectral_density_mp` (mpmath, used by the HP001
quadrature claims, which check :math:`p = \\mathcal{F}^{-1} g` to 25 digits).

* ``gaussian``: :math:`g(\\delta) = \\exp(-\\|\\delta\\|_2^2 / 2\\ell^2)`,
  :math:`p = \\mathcal{N}(0, \\ell^{-2} I_d)`;
* ``laplacian``: :math:`g(\\delta) = \\prod_i e^{-|\\delta_i|/\\ell} = e^{-\\|\\delta\\|_1/\\ell}`,
  :math:`p` = product of 1-D Cauchy densities of scale :math:`1/\\ell`;
* ``matern`` (:math:`\\nu \\in \\{1/2, 3/2, 5/2\\}`):
  :math:`g(\\delta) = \\frac{2^{1-\\nu}}{\\Gamma(\\nu)} z^\\nu K_\\nu(z)`,
  :math:`z = \\sqrt{2\\nu}\\|\\delta\\|_2/\\ell`,
  :math:`p` = multivariate Student-t with :math:`2\\nu` degrees of freedom and scale :math:`1/\\ell`.

**Which Laplacian.** ``laplacian`` is the *product* (L1) Laplacian of Rahimi & Recht,
:math:`\\exp(-\\|\\delta\\|_1/\\ell)`; it is not isotropic, its spectral density is a product
of independent 1-D Cauchy densities, and orthogonal frequencies do not apply to it.
The isotropic exponential kernel :math:`\\exp(-\\|\\delta\\|_2/\\ell)` is ``matern`` with
:math:`\\nu = 1/2` (multivariate Cauchy spectral density).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any, ClassVar

import torch

from kernelattn_core import InputError, ShiftInvariantKernel
from kernelattn_core.toolkit import KernelClosedForm, QuadratureIdentity, SpectralDensityIntegral

from . import claims as _claims

#: ``draw(kind, shape)`` returns samples of ``kind`` in ``("normal", "uniform")``;
#: feature maps pass a closure over :meth:`FeatureMap._draw` so that every random draw
#: goes through the map's explicit generator.
Draw = Callable[[str, tuple[int, ...]], torch.Tensor]


def check_lengthscale(lengthscale: object) -> float:
    """A positive finite lengthscale as a float, or :class:`InputError`."""
    if isinstance(lengthscale, bool) or not isinstance(lengthscale, int | float) or not math.isfinite(lengthscale):
        raise InputError(f"lengthscale: expected a positive finite number, got {lengthscale!r}")
    if lengthscale <= 0:
        raise InputError(f"lengthscale: expected a positive finite number, got {lengthscale!r}")
    return float(lengthscale)


def _sq_dist(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[..., N, M]`` squared Euclidean distances (clamped at 0 against round-off)."""
    qq = (q * q).sum(-1).unsqueeze(-1)  # [..., N, 1]
    kk = (k * k).sum(-1).unsqueeze(-2)  # [..., 1, M]
    return (qq + kk - 2.0 * (q @ k.transpose(-1, -2))).clamp_min(0.0)  # [..., N, M]


class SpectralKernel(ShiftInvariantKernel):
    """A shift-invariant kernel that knows its spectral density (see the module docstring).

    Attributes
    ----------
    lengthscale : float
        :math:`\\ell > 0`.
    isotropic : bool
        Whether :math:`p` depends on :math:`\\|\\omega\\|` only (then orthogonal frequencies
        with radial rescaling are unbiased).
    """

    positive: ClassVar[bool] = True
    isotropic: ClassVar[bool] = True

    def __init__(self, lengthscale: float = 1.0) -> None:
        self.lengthscale = check_lengthscale(lengthscale)

    # ------------------------------------------------------------------ spectral views
    def sample_frequencies(self, num: int, dim: int, draw: Draw) -> torch.Tensor:
        """``num`` i.i.d. frequencies :math:`\\omega \\sim p`, shape ``[num, dim]``."""
        raise NotImplementedError

    def log_spectral_density(self, omega: torch.Tensor) -> torch.Tensor:
        """:math:`\\log p(\\omega)` for ``omega [..., d]``, giving ``[...]``."""
        raise NotImplementedError

    def spectral_density_mp(self, omega: list[Any]) -> Any:
        """:math:`p(\\omega)` in mpmath at the current working precision (``omega`` a list)."""
        raise NotImplementedError

    def g_mp(self, delta: list[Any]) -> Any:
        """:math:`g(\\delta)` in mpmath (``delta`` a list of mpf)."""
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        """Constructor options that rebuild this kernel."""
        return {"lengthscale": self.lengthscale}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


class GaussianKernel(SpectralKernel):
    """The Gaussian (RBF) kernel.

    .. math:: g(\\delta) = \\exp\\left(-\\frac{\\|\\delta\\|^2}{2\\ell^2}\\right), \\qquad
              p(\\omega) = \\left(\\frac{\\ell^2}{2\\pi}\\right)^{d/2}
              \\exp\\left(-\\frac{\\ell^2\\|\\omega\\|^2}{2}\\right)
              = \\mathcal{N}(\\omega; 0, \\ell^{-2} I_d).

    In scikit-learn's convention (``RBFSampler``) :math:`\\gamma = 1/(2\\ell^2)`.

    Parameters
    ----------
    lengthscale : float
        :math:`\\ell` (default 1).

    Notes
    -----
    Claim FM005 of ``rff``: :math:`\\mathbb{E}[\\cos(\\omega^\\top\\delta)] = g(\\delta)`,
    derived symbolically by SymPy.
    """

    name: ClassVar[str] = "gaussian"

    def g(self, delta: torch.Tensor) -> torch.Tensor:
        return torch.exp(-(delta * delta).sum(-1) / (2.0 * self.lengthscale**2))

    def _evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.log_evaluate(q, k))

    def log_evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return -_sq_dist(q, k) / (2.0 * self.lengthscale**2)  # [..., N, M]

    def sample_frequencies(self, num: int, dim: int, draw: Draw) -> torch.Tensor:
        return draw("normal", (num, dim)) / self.lengthscale  # [num, d]

    def log_spectral_density(self, omega: torch.Tensor) -> torch.Tensor:
        d = omega.shape[-1]
        ell2 = self.lengthscale**2
        return 0.5 * d * math.log(ell2 / (2 * math.pi)) - 0.5 * ell2 * (omega * omega).sum(-1)

    def spectral_density_mp(self, omega: list[Any]) -> Any:
        import mpmath as mp

        ell2 = mp.mpf(self.lengthscale) ** 2
        return (ell2 / (2 * mp.pi)) ** (mp.mpf(len(omega)) / 2) * mp.exp(-ell2 * sum(w * w for w in omega) / 2)

    def g_mp(self, delta: list[Any]) -> Any:
        import mpmath as mp

        return mp.exp(-sum(t * t for t in delta) / (2 * mp.mpf(self.lengthscale) ** 2))


class _L1Distance(torch.autograd.Function):
    """``torch.cdist(q, k, p=1)`` ``[..., N, M]`` with a backward that is differentiable in
    turn (torch's ``_cdist_backward`` has no derivative, so a double backward, such as a
    gradient penalty, raised ``NotImplementedError``).

    The first-order backward is torch's own; only a backward that builds a graph
    (``create_graph=True``) takes the differentiable form
    :math:`\\partial/\\partial q_n = \\sum_m G_{nm}\\,\\mathrm{sign}(q_n - k_m)`, which
    holds an ``[..., N, M, d]`` tensor (the sign's own derivative is 0).
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
        qe, ke = q.expand(*batch, *q.shape[-2:]), k.expand(*batch, *k.shape[-2:])
        dist = torch.cdist(qe, ke, p=1.0)
        ctx.save_for_backward(qe, ke, dist)
        ctx.shapes = (q.shape, k.shape)
        return dist

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        q, k, dist = ctx.saved_tensors
        q_shape, k_shape = ctx.shapes
        if torch.is_grad_enabled():  # create_graph: a form autograd can differentiate again
            sign = torch.sign(q.unsqueeze(-2) - k.unsqueeze(-3))  # [..., N, M, d]
            weighted = grad.unsqueeze(-1) * sign
            gq, gk = weighted.sum(-2), -weighted.sum(-3)
        else:
            grad = grad.contiguous()
            gq = torch.ops.aten._cdist_backward(grad, q.contiguous(), k.contiguous(), 1.0, dist)
            gk = torch.ops.aten._cdist_backward(
                grad.mT.contiguous(), k.contiguous(), q.contiguous(), 1.0, dist.mT.contiguous()
            )
        need_q, need_k = ctx.needs_input_grad
        return (gq.sum_to_size(q_shape) if need_q else None, gk.sum_to_size(k_shape) if need_k else None)


class LaplacianKernel(SpectralKernel):
    """The product (L1) Laplacian kernel of Rahimi & Recht.

    .. math:: g(\\delta) = \\prod_{i=1}^d e^{-|\\delta_i|/\\ell} = e^{-\\|\\delta\\|_1/\\ell}, \\qquad
              p(\\omega) = \\prod_{i=1}^d \\frac{1}{\\pi}\\,\\frac{\\ell}{1 + \\ell^2 \\omega_i^2},

    a product of independent Cauchy densities of scale :math:`1/\\ell`, sampled as
    :math:`\\omega_i = \\tan(\\pi(u_i - \\tfrac12))/\\ell`, :math:`u_i \\sim U(0, 1)`.

    Not isotropic: orthogonal random features do not apply. The isotropic
    :math:`e^{-\\|\\delta\\|_2/\\ell}` is ``matern`` with :math:`\\nu = 1/2`.

    Notes
    -----
    Claims HP001: the 1-D and 2-D inverse Fourier transforms of :math:`g`, computed by
    mpmath quadrature at 40 digits, equal :math:`p` to 25 digits.
    """

    name: ClassVar[str] = "laplacian"
    isotropic: ClassVar[bool] = False

    def g(self, delta: torch.Tensor) -> torch.Tensor:
        return torch.exp(-delta.abs().sum(-1) / self.lengthscale)

    def _evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.log_evaluate(q, k))

    def log_evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return -_L1Distance.apply(q, k) / self.lengthscale  # [..., N, M]

    def sample_frequencies(self, num: int, dim: int, draw: Draw) -> torch.Tensor:
        u = draw("uniform", (num, dim))  # [num, d] in [0, 1)
        return torch.tan(math.pi * (u - 0.5)) / self.lengthscale

    def log_spectral_density(self, omega: torch.Tensor) -> torch.Tensor:
        ell = self.lengthscale
        return (math.log(ell / math.pi) - torch.log1p((ell * omega) ** 2)).sum(-1)

    def spectral_density_mp(self, omega: list[Any]) -> Any:
        import mpmath as mp

        ell = mp.mpf(self.lengthscale)
        return mp.fprod(ell / (mp.pi * (1 + (ell * w) ** 2)) for w in omega)

    def g_mp(self, delta: list[Any]) -> Any:
        import mpmath as mp

        return mp.exp(-sum(abs(t) for t in delta) / mp.mpf(self.lengthscale))


_NU = {Fraction(1, 2): 1, Fraction(3, 2): 3, Fraction(5, 2): 5}  # nu -> degrees of freedom 2 nu


def check_nu(nu: object) -> Fraction:
    """:math:`\\nu \\in \\{1/2, 3/2, 5/2\\}` as a Fraction (accepts 0.5, '3/2', Fraction(5, 2))."""
    try:
        value = Fraction(str(nu)) if isinstance(nu, str) else Fraction(nu)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # OverflowError: an infinite float
        value = None
    if isinstance(nu, bool) or value not in _NU:
        raise InputError(f"nu: expected one of 1/2, 3/2, 5/2 (0.5, 1.5, 2.5), got {nu!r}")
    return value


class MaternKernel(SpectralKernel):
    """The Matérn kernel for :math:`\\nu \\in \\{1/2, 3/2, 5/2\\}`.

    With :math:`z = \\sqrt{2\\nu}\\,\\|\\delta\\|_2 / \\ell`,

    .. math::
        g_{1/2} = e^{-z}, \\qquad g_{3/2} = (1 + z)\\, e^{-z}, \\qquad
        g_{5/2} = \\left(1 + z + \\tfrac{z^2}{3}\\right) e^{-z},

    and the spectral density is the multivariate Student-t with :math:`k = 2\\nu`
    degrees of freedom and scale :math:`s = 1/\\ell`:

    .. math::
        p(\\omega) = \\frac{\\Gamma(\\frac{k + d}{2})}{\\Gamma(\\frac{k}{2}) (k\\pi)^{d/2} s^d}
        \\left(1 + \\frac{\\|\\omega\\|^2}{k s^2}\\right)^{-\\frac{k + d}{2}}
        \\;\\propto\\; \\left(\\frac{2\\nu}{\\ell^2} + \\|\\omega\\|^2\\right)^{-(\\nu + d/2)} .

    Sampled as :math:`\\omega = \\frac{z}{\\ell}\\sqrt{k / u}` with
    :math:`z \\sim \\mathcal{N}(0, I_d)` and :math:`u = \\sum_{j=1}^{k} n_j^2 \\sim \\chi^2_k`
    (:math:`k` is 1, 3 or 5, so the chi-square is a sum of squared normals).

    Parameters
    ----------
    lengthscale : float
    nu : {0.5, 1.5, 2.5}
        Smoothness (default 3/2); strings ``"1/2"`` etc. and Fractions are accepted.

    Notes
    -----
    Claims HP001: the inverse Fourier transform of :math:`g` (a Hankel transform for
    :math:`d = 2`) equals :math:`p`, by mpmath quadrature, for each :math:`\\nu`.
    """

    name: ClassVar[str] = "matern"

    def __init__(self, lengthscale: float = 1.0, nu: float | str | Fraction = 1.5) -> None:
        super().__init__(lengthscale)
        self.nu = check_nu(nu)
        self.dof = _NU[self.nu]

    def options(self) -> dict[str, Any]:
        return {"lengthscale": self.lengthscale, "nu": float(self.nu)}

    def _radial(self, r: torch.Tensor) -> torch.Tensor:
        z = math.sqrt(2 * float(self.nu)) * r / self.lengthscale
        if self.dof == 1:
            poly = torch.ones_like(z)
        elif self.dof == 3:
            poly = 1.0 + z
        else:
            poly = 1.0 + z + z * z / 3.0
        return poly * torch.exp(-z)

    def g(self, delta: torch.Tensor) -> torch.Tensor:
        return self._radial(delta.norm(dim=-1))

    def _evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        sq = _sq_dist(q, k)
        # sqrt has an infinite derivative at 0; the clamp keeps gradients finite at q = k
        return self._radial(sq.clamp_min(torch.finfo(sq.dtype).tiny).sqrt())

    def log_evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        sq = _sq_dist(q, k)
        z = math.sqrt(2 * float(self.nu)) * sq.clamp_min(torch.finfo(sq.dtype).tiny).sqrt() / self.lengthscale
        if self.dof == 1:
            return -z
        if self.dof == 3:
            return torch.log1p(z) - z
        return torch.log1p(z + z * z / 3.0) - z

    def sample_frequencies(self, num: int, dim: int, draw: Draw) -> torch.Tensor:
        z = draw("normal", (num, dim))  # [num, d]
        u = draw("normal", (num, self.dof)).square().sum(-1, keepdim=True)  # [num, 1] ~ chi2_k
        return z * torch.sqrt(self.dof / u) / self.lengthscale

    def log_spectral_density(self, omega: torch.Tensor) -> torch.Tensor:
        d = omega.shape[-1]
        k, s = self.dof, 1.0 / self.lengthscale
        const = math.lgamma((k + d) / 2) - math.lgamma(k / 2) - 0.5 * d * math.log(k * math.pi) - d * math.log(s)
        return const - 0.5 * (k + d) * torch.log1p((omega * omega).sum(-1) / (k * s * s))

    def spectral_density_mp(self, omega: list[Any]) -> Any:
        import mpmath as mp

        d = mp.mpf(len(omega))
        k, s = mp.mpf(self.dof), 1 / mp.mpf(self.lengthscale)
        const = mp.gamma((k + d) / 2) / (mp.gamma(k / 2) * (k * mp.pi) ** (d / 2) * s**d)
        return const * (1 + sum(w * w for w in omega) / (k * s * s)) ** (-(k + d) / 2)

    def g_mp(self, delta: list[Any]) -> Any:
        import mpmath as mp

        r = mp.sqrt(sum(t * t for t in delta))
        return self.radial_mp(r)

    def radial_mp(self, r: Any) -> Any:
        """:math:`g` as a function of :math:`r = \\|\\delta\\|` in mpmath."""
        import mpmath as mp

        nu = mp.mpf(self.nu.numerator) / self.nu.denominator
        z = mp.sqrt(2 * nu) * r / mp.mpf(self.lengthscale)
        poly = {1: 1, 3: 1 + z, 5: 1 + z + z * z / 3}[self.dof]
        return poly * mp.exp(-z)


KERNELS: dict[str, type[SpectralKernel]] = {
    "gaussian": GaussianKernel,
    "laplacian": LaplacianKernel,
    "matern": MaternKernel,
}


def make_kernel(
    kernel: str | SpectralKernel, lengthscale: float = 1.0, nu: float | str | None = None
) -> SpectralKernel:
    """The spectral kernel named ``kernel`` with ``lengthscale`` (and ``nu`` for Matérn)."""
    if isinstance(kernel, SpectralKernel):
        return kernel
    if kernel not in KERNELS:
        raise InputError(f"kernel: expected one of {sorted(KERNELS)} or a SpectralKernel instance, got {kernel!r}")
    cls = KERNELS[kernel]
    if cls is MaternKernel:
        return MaternKernel(lengthscale, 1.5 if nu is None else nu)
    if nu is not None:
        raise InputError(f"nu: only the 'matern' kernel takes nu; got nu={nu!r} with kernel={kernel!r}")
    return cls(lengthscale)


# --------------------------------------------------------------------------- HP001 claims
def _fourier_inverse_1d(kernel: SpectralKernel, w: Any) -> Any:
    """:math:`p(w) = \\frac1\\pi \\int_0^\\infty g(t) \\cos(w t)\\, dt` (even :math:`g`, d = 1)."""
    import mpmath as mp

    return mp.quad(lambda t: kernel.g_mp([t]) * mp.cos(w * t), [0, mp.inf]) / mp.pi


def _hp_laplacian(dim: int, dps: int) -> tuple[Any, Any, str]:
    import mpmath as mp

    with mp.workdps(dps):
        kern = LaplacianKernel(lengthscale=1.3)
        w = [mp.mpf("0.9"), mp.mpf("-0.4")][:dim]
        if dim == 1:
            value = _fourier_inverse_1d(kern, w[0])
        else:
            # (2 pi)^-2 over R^2 = pi^-2 over the quadrant (g is even in each coordinate, so the
            # sin parts vanish); a genuine 2-D Gauss-Legendre quadrature on [0, T]^2 with
            # T = 90: the truncated tail is below 2 l e^{-T/l} / pi^2 < 1e-30 of p ~ 0.05.
            edges = mp.linspace(0, 90, 4)
            value = mp.quad(
                lambda t1, t2: kern.g_mp([t1, t2]) * mp.cos(w[0] * t1) * mp.cos(w[1] * t2),
                edges,
                edges,
                method="gauss-legendre",
            ) / (mp.pi**2)
        target = kern.spectral_density_mp(w)
    return value, target, f"laplacian l=1.3, d={dim}: (2pi)^-d int g(t) cos(w.t) dt = prod Cauchy(w; 1/l) at w={w}"


def _hp_matern(dof: int, dim: int, dps: int) -> tuple[Any, Any, str]:
    """Inverse Fourier transform of the radial Matérn :math:`g` at one frequency:
    :math:`d = 1`: :math:`\\frac1\\pi\\int_0^\\infty g\\cos`; :math:`d = 2`: the Hankel form
    :math:`\\frac1{2\\pi}\\int_0^\\infty g(r) J_0(\\rho r) r\\, dr`."""
    import mpmath as mp

    with mp.workdps(dps):
        kern = MaternKernel(lengthscale=1.3, nu=Fraction(dof, 2))
        rho = mp.mpf("0.9")
        if dim == 1:
            value = mp.quad(lambda r: kern.radial_mp(r) * mp.cos(rho * r), [0, mp.inf]) / mp.pi
        else:
            value = mp.quad(lambda r: kern.radial_mp(r) * mp.besselj(0, rho * r) * r, [0, mp.inf]) / (2 * mp.pi)
        target = kern.spectral_density_mp([rho] + [mp.mpf(0)] * (dim - 1))
    return (
        value,
        target,
        f"matern nu={dof}/2 l=1.3, d={dim}: inverse Fourier transform of g = Student-t({dof}) at |w|=0.9",
    )


def hp_laplacian_1d(dps: int) -> tuple[Any, Any, str]:
    """HP001: 1-D Laplacian spectral density (Cauchy) by quadrature."""
    return _hp_laplacian(1, dps)


def hp_laplacian_2d(dps: int) -> tuple[Any, Any, str]:
    """HP001: 2-D product-Laplacian spectral density (product of Cauchys) by 2-D quadrature."""
    return _hp_laplacian(2, dps)


def hp_matern12_1d(dps: int) -> tuple[Any, Any, str]:
    """HP001: Matérn 1/2, d = 1."""
    return _hp_matern(1, 1, dps)


def hp_matern12_2d(dps: int) -> tuple[Any, Any, str]:
    """HP001: Matérn 1/2, d = 2 (Hankel transform)."""
    return _hp_matern(1, 2, dps)


def hp_matern32_1d(dps: int) -> tuple[Any, Any, str]:
    """HP001: Matérn 3/2, d = 1."""
    return _hp_matern(3, 1, dps)


def hp_matern32_2d(dps: int) -> tuple[Any, Any, str]:
    """HP001: Matérn 3/2, d = 2 (Hankel transform)."""
    return _hp_matern(3, 2, dps)


def hp_matern52_1d(dps: int) -> tuple[Any, Any, str]:
    """HP001: Matérn 5/2, d = 1."""
    return _hp_matern(5, 1, dps)


def hp_matern52_2d(dps: int) -> tuple[Any, Any, str]:
    """HP001: Matérn 5/2, d = 2 (Hankel transform)."""
    return _hp_matern(5, 2, dps)


GaussianKernel.claims = (
    KernelClosedForm(expression=_claims.gaussian_closed_form),
    KernelClosedForm(expression=_claims.gaussian_closed_form_l07, options={"lengthscale": 0.7}),
    # negative control: the lengthscale-1 formula against the lengthscale-0.7 kernel
    KernelClosedForm(expression=_claims.gaussian_closed_form, options={"lengthscale": 0.7}, expect="fail"),
    SpectralDensityIntegral(options={"lengthscale": 0.7}),
    # negative control: the density with l and 1/l swapped, against the lengthscale-0.7 kernel
    SpectralDensityIntegral(
        options={"lengthscale": 0.7},
        density=_claims.gaussian_density_swapped_l07,
        label="N(0, l^2) (l and 1/l swapped)",
        expect="fail",
    ),
)
LaplacianKernel.claims = (
    KernelClosedForm(expression=_claims.laplacian_closed_form),
    SpectralDensityIntegral(),
    QuadratureIdentity(evaluate=hp_laplacian_1d, label="laplacian spectral density, d=1"),
    QuadratureIdentity(evaluate=hp_laplacian_2d, label="laplacian spectral density, d=2", dps=32, digits=25),
)
MaternKernel.claims = (
    KernelClosedForm(expression=_claims.matern32_closed_form, options={"nu": 1.5}),
    KernelClosedForm(expression=_claims.matern52_closed_form, options={"nu": 2.5}),
    SpectralDensityIntegral(options={"nu": 1.5}),
    SpectralDensityIntegral(options={"nu": 2.5}),
    *(
        QuadratureIdentity(evaluate=fn, label=f"matern nu={nu} spectral density, d={d}")
        for fn, nu, d in (
            (hp_matern12_1d, "1/2", 1),
            (hp_matern12_2d, "1/2", 2),
            (hp_matern32_1d, "3/2", 1),
            (hp_matern32_2d, "3/2", 2),
            (hp_matern52_1d, "5/2", 1),
            (hp_matern52_2d, "5/2", 2),
        )
    ),
)
