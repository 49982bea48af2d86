"""Feature-map attention for ``torch.compile``: one graph, no data-dependent branches.

The eager engine (:mod:`kernelattn_core.engine.grouped`) decides at run time, with one
reduction read back to Python, whether a call holds a non-finite value to quarantine,
gathers the chunks whose stabiliser moves with ``nonzero``, and writes its own backward
pass with local autograd graphs. Each of these breaks a ``torch.compile`` graph (21 breaks
per forward of a ``prf`` layer). Under compilation
(:func:`torch.compiler.is_compiling`) the torch backend runs this module instead: the
same mathematics with every check a tensor operation, differentiated by autograd, so
Dynamo traces the whole estimator as one graph (``fullgraph=True``) in training and in
eval, and Inductor fuses the masks into the surrounding kernels.

* **Quarantine, always applied.** Key rows whose features or values are not finite and
  padded keys are removed with ``masked_fill`` (the cost is a few element-wise passes the
  compiler fuses); query rows that are not finite enter as 0. The rows that see a removed
  non-finite key (causal: the later rows of its head; non-causal: every row of its head)
  and non-finite query rows are NaN at the end: the eager engine's rule, with the same
  zero gradients for the finite rows.
* **Causal form.** The engine's one causal recurrence in its compile form
  (:func:`~kernelattn_core.engine.chunked.causal_linear_attention` under ``torch.compile``),
  fed the keys stated at their prefix maximum. Chunks of ``C`` positions: inside a chunk the gated product
  :math:`A_{tj} = [j \\le t]\\, e^{m_j - m_t} \\hat\\phi_q(q_t)^\\top \\hat\\phi_k(k_j)`; across
  chunks the states
  :math:`S_c = \\sum_{c' < c} e^{M_{c'} - M_{c-1}} U_{c'}` from one ``[n_c, n_c]`` gate
  matrix (every factor :math:`\\le 1`), with
  :math:`U_c = \\sum_{j \\in c} e^{m_j - M_c} \\hat\\phi_k(k_j) \\tilde v_j^\\top`, where
  :math:`m` is the prefix maximum of the key log-features and :math:`M_c` its value at the
  end of chunk ``c`` (the causal-safe stabiliser of
  :mod:`kernelattn_core.engine.chunked`). Time :math:`O(N C D + n_c^2 D d_v)`, memory
  :math:`O(N D + n_c D d_v)`; the eager engine keeps :math:`O(N / G)` states instead and
  recomputes the features in its backward pass.

Equal to the eager engine on outputs and gradients (``tests/test_compile.py`` runs this
path eagerly against it).
"""

from __future__ import annotations

from typing import Any

import torch

from ..validation import finite_rows
from .chunked import _bad_rows, _traced, compute_dtype, prefix_stabiliser

#: positions per chunk of the traced causal form
TRACED_CHUNK = 64


def tracing() -> bool:
    """Whether Dynamo is tracing (``torch.compile``, ``torch._dynamo.explain``, export)."""
    return bool(torch.compiler.is_compiling())


def traced_feature_attention(
    feature_map: Any,
    normalizer: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    scale: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``normalizer.normalize(num, den)`` of feature-map attention on ``scale * q`` and
    ``scale * k`` (``[B, H, N, d]``, ``[B, H, M, d]``, values ``[B, H, M, dv]``), traced
    without graph breaks (module docstring). Computed in
    :func:`~kernelattn_core.engine.chunked.compute_dtype`; the caller casts back."""
    fm = feature_map
    log_space = bool(fm.log_space)
    dtype = compute_dtype(q.dtype)
    if scale != 1.0:
        q, k = q * scale, k * scale
    b, m = q.shape[0], k.shape[2]
    lq = fm.raw_features(q, query=True).to(dtype)  # [B, H, N, D]; a non-finite row is NaN (isolated)
    lk = fm.raw_features(k, query=False).to(dtype)  # [B, H, M, D]
    v = v.to(dtype)
    pad = torch.zeros(b, 1, m, dtype=torch.bool, device=q.device)
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, :]
    bad_k = (_bad_rows(lk, log_space) | ~finite_rows(v)) & ~pad  # [B, H, M]
    drop = (pad | bad_k).unsqueeze(-1)  # [B, H, M, 1]
    bad_q = _bad_rows(lq, log_space)  # [B, H, N]
    empty = float("-inf") if log_space else 0.0
    lq = lq.masked_fill(bad_q.unsqueeze(-1), empty)
    lk = lk.masked_fill(drop, empty)
    v = v.masked_fill(drop, 0.0)
    if log_space:
        a = lq.detach().amax(-1, keepdim=True)
        fq = (lq - torch.where(torch.isfinite(a), a, torch.zeros_like(a))).exp()  # [B, H, N, D], <= 1
    else:
        fq = lq
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # [B, H, M, dv + 1]: den as the last column
    if causal:
        out = _causal(fq, lk, v1, log_space, chunk_size or TRACED_CHUNK)
        poison = bad_k.cummax(-1).values | bad_q  # [B, H, N]
    else:
        if log_space:
            c = lk.detach().amax(-1).amax(-1)[..., None, None]  # [B, H, 1, 1]
            fk = (lk - torch.where(torch.isfinite(c), c, torch.zeros_like(c))).exp()
        else:
            fk = lk
        out = fq @ (fk.transpose(-1, -2) @ v1)  # [B, H, N, dv + 1]
        poison = bad_k.any(-1, keepdim=True) | bad_q
    num, den = out[..., :-1], out[..., -1]
    result = normalizer.normalize(num, den)
    return result.masked_fill(poison.unsqueeze(-1), float("nan"))


def _causal(fq: torch.Tensor, lk: torch.Tensor, v1: torch.Tensor, log_space: bool, chunk: int) -> torch.Tensor:
    """``[B, H, N, dv + 1]``: :math:`\\sum_{j \\le t} \\hat\\phi_q(q_t)^\\top \\hat\\phi_k(k_j) \\tilde v_j`
    with the prefix stabiliser (module docstring). ``lk``: key log-features (dropped keys
    ``-inf``) or plain features (dropped keys 0). The recurrence is the engine's one causal
    core in its compile form (:func:`kernelattn_core.engine.chunked.causal_linear_attention`
    under ``torch.compile``: every chunk gated, the states from one ``[n_c, n_c]`` decay
    matrix, no loop); this function only states the keys at the prefix maximum."""
    b, h, _, d_feat = fq.shape
    s0 = fq.new_zeros(b, h, d_feat, v1.shape[-1])
    if not log_space:
        out, _ = _traced(fq, lk, v1, s0, None, None, None, chunk)
        return out
    _, mk = prefix_stabiliser(lk.detach().amax(-1))  # [B, H, N], non-decreasing, finite
    fk = (lk - mk.unsqueeze(-1)).exp()  # [B, H, N, D], <= 1, dropped keys 0
    out, _ = _traced(fq, fk, v1, s0, mk, mk[..., :1], None, chunk)
    return out
