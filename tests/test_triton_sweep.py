"""A randomised sweep of the Triton backend (interpreter) against the torch backend.

Nine maps (fused exp: ``prf``, ``prf-hyperbolic``, ``cexp``; fused trig: ``rff``,
``trig-softmax-features``; materialised: ``elu``, ``hedgehog``, ``gmm-rks``, ``gmm-prf``)
x three dtypes (float32, bfloat16, float16) x causal / non-causal x with / without
padding: 108 combinations, each with its own seed drawing ``N`` in 1..130, the inputs,
ragged padding (padded keys and values hold NaN; materialised maps: only the values,
see ``test_padded_nan_key_of_a_materialised_map`` in ``test_triton_backend.py``) and,
for causal calls, a NaN, ``inf`` or ``-inf`` key or value at a random valid position.
Tiles of 16 make chunk and tile boundaries fall inside every longer sequence.

Each case checks, against the torch backend on the same inputs: the same rows are NaN;
outputs and the gradients of ``q``, ``k``, ``v`` and the map's parameters agree within
the dtype's bound wherever torch's are finite, and are finite there. CI runs the seeded
subset :data:`CI_CASES` (each map and each dtype, both modes, with and without padding:
18 cases, about a minute); ``KERNELATTN_TRITON_SWEEP=full`` runs all 108 (about
five minutes).
"""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")
pytest.importorskip("kernelattn_prf")
pytest.importorskip("kernelattn_fourier")

import kernelattn_core as ka
from kernelattn_core.builtins.estimators import FeatureMapAttention

T = pytest.importorskip("kernelattn_core.engine.triton_backend")
pytestmark = pytest.mark.skipif(not T.interpreting(), reason="needs TRITON_INTERPRET=1 (CPU interpreter)")

MAPS = [
    ("prf", {}),
    ("prf-hyperbolic", {}),
    ("cexp", {}),
    ("rff", {}),
    ("trig-softmax-features", {}),
    ("elu", {}),
    ("hedgehog", {}),
    ("gmm-rks", {}),
    ("gmm-prf", {}),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: relative-RMS bounds (output, gradients) per input dtype, over the entries where torch's
#: result is finite; torch computes half inputs in float32. Largest of the full sweep
#: (this file's shapes): float32 7.4e-5 / 2.2e-4 (trig-softmax-features, whose estimate
#: cancels; both sides IEEE float32), bfloat16 4.6e-3 / 5.4e-2 and float16 6.5e-4 / 8.2e-3
#: (log-space maps take half and TF32 operands; the gradients' cancellation amplifies
#: the forward's rounding, 2^-9 for bfloat16, 2^-11 for float16)
BOUND = {torch.float32: (5e-4, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-1), torch.float16: (2e-3, 2.5e-2)}
#: a parameter gradient that vanishes in exact arithmetic (hedgehog's log_scale cancels in
#: the ratio), against the norm of all parameter gradients: rounding noise only; measured
#: 1.1e-6 / 0.22 / 4.6e-3
VANISHING = {torch.float32: 1e-5, torch.bfloat16: 0.5, torch.float16: 2e-2}
ALL = [
    (m, dt, causal, pad)
    for m in range(len(MAPS))
    for dt in range(3)
    for causal in (True, False)
    for pad in (True, False)
]
#: two cases per map, one causal and one not, with and without padding in turn, the dtypes
#: in rotation: every map, dtype, mode and padding choice (each seeded by its place in ALL)
CI_CASES = [(m, (m + i) % 3, i == 0, (m + i) % 2 == 0) for m in range(len(MAPS)) for i in range(2)]
CASES = ALL if os.environ.get("KERNELATTN_TRITON_SWEEP") == "full" else CI_CASES


def _case_id(case) -> str:
    m, dt, causal, pad = case
    dtype = str(DTYPES[dt]).removeprefix("torch.")
    return f"{MAPS[m][0]}-{dtype}-{'causal' if causal else 'full'}-{'pad' if pad else 'nopad'}"


def test_ci_subset_covers_every_map_dtype_mode_and_padding():
    assert set(CI_CASES) <= set(ALL) and len(set(CI_CASES)) == 18
    assert {c[0] for c in CI_CASES} == set(range(len(MAPS)))
    for m in range(len(MAPS)):
        assert {c[2] for c in CI_CASES if c[0] == m} == {True, False}
    assert {c[1] for c in CI_CASES} == {0, 1, 2} and {c[3] for c in CI_CASES} == {True, False}
    for dt in range(3):
        assert {c[2] for c in CI_CASES if c[1] == dt} == {True, False}


def errors(case) -> dict[str, float]:
    """Run one case on both backends; check that the same rows are NaN and that the
    Triton results are finite wherever torch's are; return the relative RMS errors of
    the output and the ``q``, ``k``, ``v`` gradients (each against its own norm) and of the
    map's parameter gradients (against the norm of all of them: a parameter whose
    gradient is 0 in exact arithmetic, as hedgehog's ``log_scale``, carries rounding noise)."""
    m, dt, causal, pad = case
    name, opts = MAPS[m]
    dtype = DTYPES[dt]
    seed = ALL.index(case)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    n = rng.randint(1, 130)
    b, h, d = 2, 1, 8
    torch.manual_seed(seed)
    est = FeatureMapAttention(name, num_features=16, head_dim=d, **opts).float()
    fused = est.feature_map.fused_spec() is not None
    q, k, v = (0.7 * torch.randn(b, h, n, d, generator=g) for _ in range(3))
    mask = None
    if pad and n > 1:
        mask = torch.zeros(b, n, dtype=torch.bool)
        mask[1, rng.randint(1, n - 1) :] = True  # ragged
        if rng.random() < 0.5:
            mask[0, : rng.randint(1, n - 1)] = True  # left padding
        v[mask[:, None, :].expand(b, h, n)] = float("nan")
        if fused:  # materialised maps: test_padded_nan_key_of_a_materialised_map
            k[mask[:, None, :].expand(b, h, n)] = float("nan")
    if causal and n > 1 and rng.random() < 0.8:  # a non-finite future key or value
        j = rng.randint(1, n - 1)
        value = rng.choice([float("nan"), float("inf"), float("-inf")])
        (k if rng.random() < 0.5 else v)[0, 0, j, rng.randrange(d)] = value
    q, k, v = (t.to(dtype) for t in (q, k, v))

    state = copy.deepcopy(est.state_dict())  # cexp's prepare updates running statistics: both runs start alike

    def run(backend: str) -> list[torch.Tensor]:
        est.load_state_dict(state)
        est.zero_grad()
        a, b_, c = (t.clone().requires_grad_() for t in (q, k, v))
        with T.tiles(bt=16, bk=16, bv=16, be=16):
            out = ka.kernel_attention(a, b_, c, est, causal=causal, key_padding_mask=mask, backend=backend)
            out.float().nan_to_num(0.0, 0.0, 0.0).square().sum().backward()
        params = [p.grad.clone() for p in est.parameters() if p.grad is not None]
        return [out, a.grad, b_.grad, c.grad, *params]

    ref = run("torch")
    got = run("triton")
    assert est.last_backend == "triton"
    assert len(got) == len(ref)
    assert torch.equal(torch.isnan(got[0]), torch.isnan(ref[0])), "different rows are NaN"
    names = ["out", "dq", "dk", "dv"] + [f"param{i}" for i in range(len(ref) - 4)]
    finite = [r.double()[torch.isfinite(r)] for r in ref[4:]]  # a NaN key makes them NaN in both backends
    params_norm = torch.cat(finite).norm() if finite else None
    errs = {}
    for what, a, r in zip(names, got, ref):
        ok = torch.isfinite(r)
        assert bool(torch.isfinite(a[ok]).all()), f"{what}: not finite where torch's is"
        diff = (a.double() - r.double())[ok].norm()
        own = r.double()[ok].norm()
        if what.startswith("param"):
            if own < 1e-3 * params_norm:
                what = f"{what} (vanishing)"
            own = params_norm
        errs[what] = 0.0 if own == 0 else (diff / own).item()
    return errs


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_triton_equals_torch_backend(case):
    dtype = DTYPES[case[1]]
    for what, err in errors(case).items():
        bound = VANISHING[dtype] if what.endswith("(vanishing)") else BOUND[dtype][0 if what == "out" else 1]
        assert err < bound, f"{what}: relative RMS {err:.2e}, bound {bound:.0e}"
