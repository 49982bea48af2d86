"""The claims of the hybrid plugin (declared as data on :class:`~kernelattn_hybrid.SlidingWindowAttention`
and :class:`~kernelattn_hybrid.HedgehogFeatureMap`) and the callables they refer to.

* ``sliding-window``: EN001 against :func:`~kernelattn_hybrid.naive.window_attention_naive`
  built from the estimator's own features, over every window mode (no window, a
  window inside a block, a window of a whole block, a window covering the sequence),
  global tokens and maps (log-space learned, log-space random, plain), and with heavy
  keys (non-causal; chosen by the reference from the full feature matrix,
  :func:`~kernelattn_hybrid.naive.heavy_keys_naive`); AT002 with and without global
  tokens.
* ``hedgehog``: RT001, the features are the stated formula at trained-like parameters
  for each activation, per-head and shared weights; ``tied`` shares the two sides; the
  ``prf`` initialisation is antithetic positive random features of one fixed Gaussian
  draw; EN001 at trained-like parameters (the outputs and the gradients a fit follows).

The module imports nothing from the estimator or the map (they import it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kernelattn_core.toolkit import ConsistentAttention, EngineReference, RuntimeIdentity

from .naive import heavy_keys_naive, leading_padding, window_attention_naive


# --------------------------------------------------------------------------- sliding-window
def _naive_of(
    est: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    *,
    global_tokens: bool = True,
    heavy: bool = True,
) -> torch.Tensor:
    """:func:`~kernelattn_hybrid.naive.window_attention_naive` from the estimator's map (its
    ``prepare`` and raw features) and options; the controls leave out the global tokens
    or the heavy keys."""
    fm = est.feature_map
    fm.prepare(q, k, key_padding_mask=key_padding_mask, causal=causal)
    phi_q, phi_k = fm.raw_features(q, query=True), fm.raw_features(k, query=False)
    offset = None if key_padding_mask is None else leading_padding(key_padding_mask)
    return window_attention_naive(
        q,
        k,
        v,
        phi_q,
        phi_k,
        log_space=fm.log_space,
        window=est.window,
        global_tokens=est.global_tokens if global_tokens else 0,
        causal=causal,
        key_padding_mask=key_padding_mask,
        global_offset=offset if global_tokens else None,
        heavy=_heavy_reference(est, phi_q, phi_k, key_padding_mask, offset) if heavy else None,
    )


def sliding_window_reference(
    est: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, key_padding_mask: torch.Tensor | None
) -> torch.Tensor:
    """EN001 reference: the full ``[N, M]`` weight matrix of
    :func:`~kernelattn_hybrid.naive.window_attention_naive` from the estimator's map (its
    ``prepare`` and raw features), window and global tokens (counted from each row's
    leading padding, :func:`~kernelattn_hybrid.naive.leading_padding`), and the heavy keys
    chosen from the full feature-map attention matrix
    (:func:`~kernelattn_hybrid.naive.heavy_keys_naive`)."""
    return _naive_of(est, q, k, v, causal, key_padding_mask)


def _heavy_reference(est: Any, phi_q: torch.Tensor, phi_k: torch.Tensor, kpm: Any, offset: Any) -> Any:
    """The heavy keys by :func:`~kernelattn_hybrid.naive.heavy_keys_naive`: among the valid
    keys that are not global tokens, the mass summed over the valid queries (``None``
    without heavy keys)."""
    s = getattr(est, "heavy_keys", 0)
    if not s:
        return None
    n, m = phi_q.shape[-2], phi_k.shape[-2]
    pos = torch.arange(m, device=phi_k.device)
    o = torch.zeros(phi_k.shape[0], 1, dtype=torch.long, device=phi_k.device) if offset is None else offset[:, None]
    eligible = (pos < o) | (pos >= o + est.global_tokens)
    valid = None if kpm is None else ~kpm
    rows = valid if (valid is not None and n == m) else None
    return heavy_keys_naive(
        phi_q, phi_k, s, log_space=est.feature_map.log_space, eligible=eligible, key_valid=valid, query_valid=rows
    )


def sliding_window_reference_no_heavy(
    est: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, key_padding_mask: torch.Tensor | None
) -> torch.Tensor:
    """Negative control of the heavy-key EN001: the reference with the heavy keys left
    out (they enter through the features), which the estimator must not equal."""
    return _naive_of(est, q, k, v, causal, key_padding_mask, heavy=False)


def sliding_window_reference_no_globals(
    est: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, key_padding_mask: torch.Tensor | None
) -> torch.Tensor:
    """Negative control of EN001: the reference with the global tokens left out (they
    enter through the features instead of exactly), which the estimator must not equal."""
    return _naive_of(est, q, k, v, causal, key_padding_mask, global_tokens=False, heavy=False)


#: every window mode (seq_len 23, block max(window, 32)): none, inside a block, several
#: blocks of 4 positions (block_size 4: far blocks, the causal prefix scan), covering the
#: whole sequence; global tokens with each; three kinds of map; and the dense form that
#: short inputs take when no block length is given (``block_size=None``)
SLIDING_WINDOW_GRID: tuple[dict[str, Any], ...] = (
    {"window": 3, "global_tokens": 2, "block_size": 4},
    {"window": 3, "global_tokens": 2, "block_size": None},
    {"window": 0},
    {"window": 1, "global_tokens": 3, "block_size": 4, "feature_map": "prf"},
    {"window": 4, "block_size": 4, "feature_map": "elu"},
    {"window": 30, "global_tokens": 1, "block_size": None},
    {"window": 2, "global_tokens": 2, "block_size": 5, "feature_map": "prf-hyperbolic"},
    {"window": 2, "global_tokens": 2, "feature_map": "hedgehog", "activation": "softmax", "tied": True},
)

#: heavy keys with each form and map kind (non-causal; seq_len 23)
HEAVY_GRID: tuple[dict[str, Any], ...] = (
    {"window": 2, "global_tokens": 1, "heavy_keys": 3, "block_size": None},
    {"window": 0, "heavy_keys": 5, "block_size": 4},
    {"window": 3, "global_tokens": 2, "heavy_keys": 2, "block_size": 5, "feature_map": "elu"},
    {"window": 1, "heavy_keys": 4, "block_size": None, "feature_map": "prf"},
)

SLIDING_WINDOW_CLAIMS: tuple[Any, ...] = (
    EngineReference(
        reference=sliding_window_reference,
        options={"window": 2, "global_tokens": 1, "block_size": 4},
        grid=SLIDING_WINDOW_GRID,
        perturb=0.2,
    ),
    # the same check with the global tokens left out of the reference must fail: EN001 sees them
    EngineReference(
        reference=sliding_window_reference_no_globals,
        options={"window": 2, "global_tokens": 2, "block_size": 4},
        expect="fail",
    ),
    # heavy keys (non-causal): the blocked form (far blocks at block 4), the dense form, with
    # and without global tokens, log-space and plain maps; the reference chooses them from the
    # full feature matrix. Left out of the reference, the check must fail.
    EngineReference(
        reference=sliding_window_reference,
        options={"window": 2, "global_tokens": 1, "heavy_keys": 3, "block_size": 4},
        grid=HEAVY_GRID,
        modes=(False,),
        perturb=0.2,
    ),
    EngineReference(
        reference=sliding_window_reference_no_heavy,
        options={"window": 2, "global_tokens": 1, "heavy_keys": 3, "block_size": 4},
        modes=(False,),
        expect="fail",
    ),
    # with unbiased random features outside the window (prf), the error and the bias of the
    # self-normalised ratio shrink as the feature budget grows; with global tokens too
    ConsistentAttention(
        options={"window": 2, "feature_map": "prf"},
        grid=({"window": 2, "feature_map": "prf", "global_tokens": 2},),
    ),
)


# --------------------------------------------------------------------------- hedgehog
def _heads(fm: Any) -> int:
    return fm.num_heads or 3  # a shared map is checked on three heads (the same map for each)


def hedgehog_formula(fm: Any, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, str]:
    """RT001: ``query(x)`` and ``key(x)`` against the docstring's formula computed from the
    map's parameters: :math:`u = x W_h + b_h`, features :math:`e^{\\beta_h}[e^u, e^{-u}]`
    (``exp``) or :math:`e^{\\beta_h}[\\mathrm{softmax}(u), \\mathrm{softmax}(-u)]`
    (``softmax``), times :math:`e^{-\\|x\\|^2/2}` with ``init="prf"``; per head, or one map
    for every head."""
    h, d = _heads(fm), fm.head_dim
    x = torch.randn(2, h, 5, d, generator=generator, dtype=torch.float64) * 0.8
    got, want = [], []
    for query, w, b in ((True, fm.weight_q, fm.bias_q), (False, fm.weight_k, fm.bias_k)):
        got.append(fm.query(x) if query else fm.key(x))
        rows = []
        for head in range(h):
            p = head if fm.num_heads is not None else 0
            u = x[:, head] @ w[p].double() + b[p].double()  # [2, 5, m]
            if fm.activation == "exp":
                feats = torch.cat([torch.exp(u), torch.exp(-u)], -1)
            else:
                feats = torch.cat([torch.softmax(u, -1), torch.softmax(-u, -1)], -1)
            scale = math.exp(float(fm.log_scale[p]))
            if fm.init == "prf":
                scale = scale * torch.exp(-0.5 * (x[:, head] ** 2).sum(-1, keepdim=True))
            rows.append(feats * scale)
        want.append(torch.stack(rows, 1))
    note = f"activation={fm.activation}, num_heads={fm.num_heads}, init={fm.init}, tied={fm.tied}"
    return torch.cat(got, -1), torch.cat(want, -1), note


def hedgehog_tied(fm: Any, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, str]:
    """RT001 (``tied=True``): the key map is the query map, at trained-like parameters."""
    x = torch.randn(2, _heads(fm), 5, fm.head_dim, generator=generator, dtype=torch.float64)
    return fm.key(x), fm.query(x), "key(x) == query(x)"


def hedgehog_prf_init(fm: Any, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, str]:
    """RT001 (``init="prf"``, before any fit): antithetic positive random features
    :math:`\\frac{1}{\\sqrt{2m}} e^{\\pm w_r^\\top x - \\|x\\|^2/2}` of one Gaussian draw
    :math:`W` (seed 0, ``torch.randn(d, m)``), the same on both sides, so that
    :math:`\\phi_q(q)^\\top\\phi_k(k)` is the antithetic PRF estimate of :math:`e^{q^\\top k}`."""
    d, m = fm.head_dim, fm.num_features // 2
    w = torch.randn(d, m, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = torch.randn(2, _heads(fm), 5, d, generator=generator, dtype=torch.float64) * 0.8
    u = x @ w
    norm = -0.5 * (x**2).sum(-1, keepdim=True)
    want = torch.cat([u, -u], -1).add(norm).exp() / math.sqrt(2 * m)
    return torch.cat([fm.query(x), fm.key(x)], -1), torch.cat([want, want], -1), "antithetic PRF of W ~ N(0, 1), seed 0"


HEDGEHOG_CLAIMS: tuple[Any, ...] = (
    RuntimeIdentity(
        evaluate=hedgehog_formula,
        label="hedgehog features",
        perturb=0.3,
        options={"num_heads": 2},
        grid=(
            {"activation": "softmax"},
            {"num_heads": None},
            {"activation": "softmax", "num_heads": None, "init": "prf"},
            {"init": "prf", "tied": True},
        ),
    ),
    RuntimeIdentity(
        evaluate=hedgehog_tied,
        label="tied hedgehog",
        perturb=0.3,
        options={"tied": True, "num_heads": 2},
        grid=({"tied": True, "activation": "softmax", "num_heads": None},),
    ),
    RuntimeIdentity(
        evaluate=hedgehog_prf_init,
        label="hedgehog init='prf'",
        rtol=1e-6,  # the draw is stored in the parameters' dtype (float32 by default): 1e-7 rounding
        options={"init": "prf"},
        grid=({"init": "prf", "num_heads": 2},),
    ),
    # the fitted map: outputs and gradients at trained-like parameters, per head, both activations
    EngineReference(
        perturb=0.3,
        options={"num_heads": 2},
        grid=({"num_heads": 2, "activation": "softmax", "tied": True}, {"init": "prf"}),
    ),
)

__all__ = [
    "HEDGEHOG_CLAIMS",
    "SLIDING_WINDOW_CLAIMS",
    "hedgehog_formula",
    "hedgehog_prf_init",
    "hedgehog_tied",
    "sliding_window_reference",
]
