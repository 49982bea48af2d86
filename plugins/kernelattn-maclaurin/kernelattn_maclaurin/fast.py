"""The plugin's fast paths with hand-written backward passes (``naive.py`` holds the
references they are tested against).

Three element-wise pipelines dominate a SchoenbAt training step at the task benchmarks'
shapes (B 32, H 2, N 128, d 32, D 64, one thread): the degree products of the random
Maclaurin features, ppSBN's centred unit rows and its signed power. Composed of torch
operations, each records five to twelve autograd nodes whose backward passes re-read
every intermediate (``prod``'s backward divides by its inputs after a search for zeros;
the products of one degree are strided slices of the projections, so every factor is a
strided element-wise pass). Here each is one :class:`torch.autograd.Function`:

* :func:`degree_products`: the projections are formed transposed, ``[S, M]`` for ``M``
  rows, so each degree group is a contiguous ``[n, c, M]`` block and every factor a
  contiguous pass; the backward pass forms the factors' co-products from prefix and
  suffix products (exact at zero factors, no division).
* :func:`unit_rows`: :math:`s (x - \\bar x)/\\lVert x - \\bar x\\rVert` in one node.
* :func:`signed_power`: :math:`\\gamma\\,\\mathrm{sign}(a)\\,|a|^{\\beta}` in one node.

Measured 2026-11-26 at the shape above, forward + backward of one call, one thread:
features 6.7 -> 2.4 ms per side, unit rows 5.9 -> 1.7 ms per side; a whole SchoenbAt
training step 0.68x (ListOps) and 0.76x (induction) its former time, an RMFA step 0.90x.

**Second derivatives.** Each backward pass is first-order code. Under ``create_graph=True``
(gradient penalties) it recomputes the forward pass from the saved inputs with ordinary
torch operations and differentiates that, so higher derivatives stay exact (tested with
``gradgradcheck``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: ``(degree n, count c)`` of each group of features, ascending in ``n``
Groups = tuple[tuple[int, int], ...]


# --------------------------------------------------------------------------- degree products
def degree_products(
    x: torch.Tensor, omega: torch.Tensor, weights: torch.Tensor, groups: Groups, constant: bool
) -> torch.Tensor:
    """Random Maclaurin features ``[..., D]`` of ``x [..., d]``.

    .. math:: \\Phi_i(x) = w_i \\prod_{j=1}^{n_i} \\langle \\omega_{ij}, x \\rangle

    ``omega [S, d]`` holds the projections group after group, a group of ``c`` features
    of degree ``n`` as ``n * c`` rows laid out ``[n, c]``; ``weights [D]`` the
    :math:`w_i`; with ``constant`` the first feature is the constant :math:`w_0` (the
    released mode). Degree-0 features are their weights.
    """
    return _DegreeProducts.apply(x, omega, weights, groups, constant)


def degree_products_composed(
    x: torch.Tensor, omega: torch.Tensor, weights: torch.Tensor, groups: Groups, constant: bool
) -> torch.Tensor:
    """:func:`degree_products` as plain torch operations (the differentiable form its
    backward pass uses under ``create_graph=True``)."""
    proj = x @ omega.transpose(0, 1)  # [..., S]
    blocks = iter(torch.split(proj, [n * c for n, c in groups if n > 0], dim=-1))
    one = torch.ones_like(x[..., :1])
    parts = [one] if constant else []
    for n, c in groups:
        parts.append(one.expand(*x.shape[:-1], c) if n == 0 else next(blocks).unflatten(-1, (n, c)).prod(-2))
    return torch.cat(parts, dim=-1) * weights


class _DegreeProducts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, omega, weights, groups, constant):  # type: ignore[no-untyped-def, override]
        lead, d = x.shape[:-1], x.shape[-1]
        xm = x.reshape(-1, d)  # [M, d]
        proj_t = omega @ xm.transpose(0, 1)  # [S, M]: every factor a contiguous row
        width = sum(c for _, c in groups) + int(constant)
        out_t = proj_t.new_empty(width, xm.shape[0])  # [D, M]
        col, off = int(constant), 0
        if constant:
            out_t[0] = 1.0
        for n, c in groups:
            dest = out_t[col : col + c]
            if n == 0:
                dest.fill_(1.0)
            else:
                block = proj_t[off : off + n * c].view(n, c, -1)
                if n == 1:
                    dest.copy_(block[0])
                else:
                    torch.mul(block[0], block[1], out=dest)
                    for j in range(2, n):
                        dest.mul_(block[j])
            col, off = col + c, off + n * c
        out_t.mul_(weights.unsqueeze(-1))
        ctx.save_for_backward(x, omega, weights, proj_t)
        ctx.groups, ctx.constant = groups, constant
        return out_t.transpose(0, 1).reshape(*lead, width)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        x, omega, weights, proj_t = ctx.saved_tensors
        if torch.is_grad_enabled() or any(ctx.needs_input_grad[1:3]):
            return _composed_grads(ctx, degree_products_composed, (x, omega, weights), g, ctx.groups, ctx.constant)
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        g_t = g.reshape(-1, g.shape[-1]).transpose(0, 1) * weights.unsqueeze(-1)  # [D, M]
        gp_t = torch.empty_like(proj_t)  # [S, M]: every group writes its rows
        col = int(ctx.constant)
        off = 0
        for n, c in ctx.groups:
            if n == 0:
                col += c
                continue
            gg = g_t[col : col + c]  # [c, M]
            block = proj_t[off : off + n * c].view(n, c, -1)
            grad = gp_t[off : off + n * c].view(n, c, -1)
            if n == 1:
                grad[0].copy_(gg)
            elif n == 2:
                torch.mul(gg, block[1], out=grad[0])
                torch.mul(gg, block[0], out=grad[1])
            else:  # factor j's co-product: (prefix up to j - 1) * (suffix from j + 1)
                prefix = block.cumprod(0)
                suffix = block.flip(0).cumprod(0).flip(0)
                grad[0].copy_(suffix[1])
                grad[n - 1].copy_(prefix[n - 2])
                torch.mul(prefix[: n - 2], suffix[2:], out=grad[1 : n - 1])
                grad.mul_(gg.unsqueeze(0))
            col, off = col + c, off + n * c
        gx = (gp_t.transpose(0, 1) @ omega).view(x.shape)
        return gx, None, None, None, None


# --------------------------------------------------------------------------- ppSBN's unit rows
def unit_rows(x: torch.Tensor, scale: float) -> torch.Tensor:
    """:math:`s\\,(x - \\bar x) / \\lVert x - \\bar x \\rVert` per row of ``x [..., d]``
    (:math:`\\bar x` the row's mean); a constant row (:math:`x = \\bar x` exactly) gives the
    zero row, with a zero gradient."""
    return _UnitRows.apply(x, scale)


def unit_rows_composed(x: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`unit_rows` as plain torch operations."""
    c = x - x.mean(-1, keepdim=True)
    ss = (c * c).sum(-1, keepdim=True)
    inv = torch.where(ss > 0, ss, torch.ones_like(ss)).rsqrt() * (ss != 0)
    return c * (inv * scale)


class _UnitRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):  # type: ignore[no-untyped-def, override]
        c = x - x.mean(-1, keepdim=True)
        ss = (c * c).sum(-1, keepdim=True)
        inv = torch.where(ss > 0, ss, torch.ones_like(ss)).rsqrt_().masked_fill_(ss == 0, 0.0)  # 0: a constant row
        u = c.mul_(inv)  # unit rows (zero rows where constant)
        ctx.save_for_backward(x, u, inv)
        ctx.scale = scale
        return u * scale

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        x, u, inv = ctx.saved_tensors
        if torch.is_grad_enabled():
            return _composed_grads(ctx, unit_rows_composed, (x,), g, ctx.scale)
        # d(c / |c|) = (I - u u^T) / |c|, then the centring's transpose (subtract the mean)
        gc = (g - u * (u * g).sum(-1, keepdim=True)).mul_(inv * ctx.scale)
        return gc.sub_(gc.mean(-1, keepdim=True)), None


# --------------------------------------------------------------------------- ppSBN's signed power
def signed_power(a: torch.Tensor, beta: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """:math:`\\gamma\\,\\mathrm{sign}(a)\\,|a|^{\\beta}`, with :math:`|a|` clamped at the
    smallest normal number of its dtype inside the power (a finite
    :math:`\\partial/\\partial\\beta \\propto \\log|a|` at 0). ``beta`` and ``gamma`` are
    scalars or ``[dv]`` (per channel, broadcast along the last axis of ``a``)."""
    return _SignedPower.apply(a, beta, gamma)


def signed_power_composed(a: torch.Tensor, beta: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """:func:`signed_power` as plain torch operations."""
    return gamma * (torch.sign(a) * torch.exp(beta * a.abs().clamp_min(torch.finfo(a.dtype).tiny).log()))


class _SignedPower(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, beta, gamma):  # type: ignore[no-untyped-def, override]
        log_abs = a.abs().clamp_min_(torch.finfo(a.dtype).tiny).log_()
        y = torch.mul(log_abs, beta).exp_().mul_(torch.sign(a))  # sign(a) |a|^beta
        ctx.save_for_backward(a, beta, gamma, log_abs, y)
        return y * gamma

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        a, beta, gamma, log_abs, y = ctx.saved_tensors
        if torch.is_grad_enabled():
            return _composed_grads(ctx, signed_power_composed, (a, beta, gamma), g)
        need_a, need_beta, need_gamma = ctx.needs_input_grad
        ga = gb = gg = None
        if need_a:  # beta |a|^(beta - 1); 0 where |a| sits at the clamp (and sign has none)
            slope = torch.mul(log_abs, beta - 1.0).exp_().mul_(beta * gamma)
            ga = slope.mul_(g).masked_fill_(a.abs() < torch.finfo(a.dtype).tiny, 0.0)  # as clamp_min's
        if need_beta:
            gb = _reduce_to(g * gamma * y * log_abs, beta)
        if need_gamma:
            gg = _reduce_to(g * y, gamma)
        return ga, gb, gg


def _reduce_to(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` summed down to the shape of ``like`` (a scalar, or the last axis)."""
    if like.dim() == 0:
        return t.sum()
    return t.reshape(-1, t.shape[-1]).sum(0).reshape(like.shape)


# --------------------------------------------------------------------------- create_graph
def _composed_grads(
    ctx: object,
    composed: Callable[..., torch.Tensor],
    inputs: tuple[torch.Tensor, ...],
    g: torch.Tensor,
    *options: object,
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``composed(*inputs, *options)`` weighted by ``g``, with a graph
    (the backward pass under ``create_graph=True``), then ``None`` for the options."""
    need = ctx.needs_input_grad[: len(inputs)]  # type: ignore[attr-defined]
    wanted = [t for t, w in zip(inputs, need) if w]
    with torch.enable_grad():
        out = composed(*inputs, *options)
        got = iter(torch.autograd.grad(out, wanted, g, create_graph=True, allow_unused=True))
    grads = [next(got) if w else None for w in need]
    return (*grads, *([None] * len(options)))
