"""Memory-bounded randomized attention (RA): the same estimator, queries in blocks.

RA is quadratic by design (every sample :math:`\\omega_{ns}` meets every key), but its
memory need not be: the full path holds the attention probabilities
:math:`\\pi \\in \\mathbb{R}^{N \\times M}` and the sample logits
:math:`\\in \\mathbb{R}^{NS \\times M}` at once. Here the queries are processed in blocks
of ``block`` rows, so the work space is :math:`O(\\mathrm{block}\\cdot S \\cdot M)`; causal
blocks see only the keys up to their last row (half the work of masking a full row).

Evaluation draws are position-addressed (:func:`~kernelattn_sampling.functional.counter_uniform`),
so in evaluation the blocked path draws the same samples as the full path and agrees
with it up to rounding; training draws come from the generator block by block (a
different, equally distributed sample).
"""

from __future__ import annotations

import functools

import torch

from . import functional as fn

#: use the blocked path once ``N * M * S`` exceeds this many elements (16 MiB of float32)
THRESHOLD = 1 << 22
#: rows per block: block * S * M elements of work space
BLOCK_ELEMENTS = 1 << 22


def use_blocks(n: int, m: int, samples: int) -> bool:
    """Whether RA of ``n`` queries, ``m`` keys and ``samples`` draws takes the blocked path."""
    return n * m * samples > THRESHOLD


def ra_blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    causal: bool,
    samples: int,
    noise_std: float,
    generator: torch.Generator | None,
    *,
    noise: bool,
    counter_seed: int | None,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RA (Eq. 30) of ``q [B, H, N, d]`` over ``k [B, H, M, d]``, ``v [B, H, M, dv]`` in
    blocks of queries: ``([B, H, N, dv], overflow rows [B, H, N] or None)``, the rows
    whose output overflowed computed again out of the samples' graph (see
    :func:`~kernelattn_sampling.functional.ra_from_samples_isolated`; the caller makes them
    NaN). Arguments as in :func:`~kernelattn_sampling.functional.ra_samples`."""
    b, h, n, d = q.shape
    m = k.shape[-2]
    if block is None:
        block = max(1, BLOCK_ELEMENTS // max(1, samples * m))
    u_all = eps_all = None
    if counter_seed is not None:  # position-addressed: the draws of the full path, sliced
        u_all = fn.counter_uniform(counter_seed, (b, h, n, samples), 0, q.device)  # [B, H, N, S]
        if noise and noise_std != 0:
            eps_all = fn.counter_normal(counter_seed, (b, h, n, samples, d), 1, q)  # [B, H, N, S, d]
    overflow = torch.zeros(b, h, n, dtype=torch.bool, device=q.device)
    q_blocks = q.split(block, dim=2)  # one autograd node for all blocks (no per-block full-size gradient)
    k_blocks, v_blocks = k.split(block, dim=2), v.split(block, dim=2)
    outs = []
    for j, qb in enumerate(q_blocks):
        i0, i1 = j * block, j * block + qb.shape[2]
        if causal:  # keys 0..i1-1 only
            kk = torch.cat(k_blocks[: j + 1], dim=2) if j else k_blocks[0]
            vv = torch.cat(v_blocks[: j + 1], dim=2) if j else v_blocks[0]
            mask = None if key_padding_mask is None else key_padding_mask[:, :i1]
            rows = torch.arange(i0, i1, device=q.device)
            allowed = torch.arange(i1, device=q.device)[None, :] <= rows[:, None]  # [Q, i1]
        else:
            kk, vv, mask, allowed = k, v, key_padding_mask, None
        logits = fn.scores(qb, kk)  # [B, H, Q, M']: a non-finite key stays in its column, gradients too
        if mask is not None:
            logits = logits.masked_fill(mask[:, None, None, :], fn.NEG_INF)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, fn.NEG_INF)
        top = logits.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        w = (logits - top).exp()
        den = w.sum(-1, keepdim=True)
        probs = w / torch.where(den == 0, torch.ones_like(den), den)  # [B, H, Q, M']
        if u_all is None:
            idx = fn.draw_indices(probs, samples, generator)
        else:
            cdf = probs.detach().to(torch.float64).cumsum(-1)
            idx = fn.inverse_cdf(cdf, u_all[:, :, i0:i1].contiguous()).clamp_max(probs.shape[-1] - 1)
        omega = qb.unsqueeze(3) + fn.gather_rows(kk, idx)  # [B, H, Q, S, d]
        if noise and noise_std != 0:
            eps = fn.draw_normal(tuple(omega.shape), omega, generator) if eps_all is None else eps_all[:, :, i0:i1]
            omega = omega + noise_std * eps
        bias = fn.key_log_bias(kk, mask)  # [B, H, 1, M']
        seen = None if allowed is None else allowed.repeat_interleave(samples, dim=0)  # [Q*S, M']
        # rows whose f overflows (finite but huge inputs) are cut from the samples' graph
        output_of = functools.partial(fn.samples_output, k=kk, v=vv, bias=bias, allowed=seen)
        out, bad = fn.output_isolated(output_of, omega)  # [B, H, Q, dv], [B, H, Q] or None
        if bad is not None:
            overflow[:, :, i0:i1] |= bad
        outs.append(out)
    return torch.cat(outs, dim=2), (overflow if bool(overflow.any()) else None)
