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
import json
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
interp = pytest.mark.skipif(not T.interpreting(), reason="needs TRITON_INTERPRET=1 (CPU interpreter)")

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
    """Run one case of the sweep on both backends (interpreter, tiles of 16) and return
    :func:`compare`'s errors."""
    m, dt, causal, pad = case
    name, opts = MAPS[m]
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
    dtype = DTYPES[dt]
    with T.tiles(bt=16, bk=16, bv=16, be=16):
        return compare(est, *(t.to(dtype) for t in (q, k, v)), mask, causal)


def compare(est, q, k, v, mask, causal: bool) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Run ``est`` on both backends; check that the same rows are NaN and that the
    Triton results are finite wherever torch's are; return the relative RMS errors of
    the output and the ``q``, ``k``, ``v`` gradients (each against its own norm) and of the
    map's parameter gradients (against the norm of all of them: a parameter whose
    gradient is 0 in exact arithmetic, as hedgehog's ``log_scale``, carries rounding noise)."""
    state = copy.deepcopy(est.state_dict())  # cexp's prepare updates running statistics: both runs start alike

    def run(backend: str) -> list[torch.Tensor]:
        est.load_state_dict(state)
        est.zero_grad()
        a, b_, c = (t.clone().requires_grad_() for t in (q, k, v))
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
        lost = ok & ~torch.isfinite(a)
        if bool(lost.any()):
            # a half result at the edge of its range may round past it on one side only
            edge = torch.finfo(r.dtype).max / 8 if r.dtype in (torch.float16, torch.bfloat16) else float("inf")
            near = float(r[lost].abs().min())
            assert near >= edge, f"{what}: {int(lost.sum())} entries not finite where torch's is (|torch| {near:.3g})"
            ok &= torch.isfinite(a)
        diff = (a.double() - r.double())[ok].norm()
        own = r.double()[ok].norm()
        if what.startswith("param"):
            if own < 1e-3 * params_norm:
                what = f"{what} (vanishing)"
            own = params_norm
        errs[what] = 0.0 if own == 0 else (diff / own).item()
    return errs


def check_bounds(errs: dict[str, float], dtype: torch.dtype, case_id: str = "", bounds=BOUND, vanishing=VANISHING):  # type: ignore[no-untyped-def]
    """Each error of ``errs`` below its bound; with ``KERNELATTN_TRITON_ERRORS`` set, the
    errors are first appended to that file as one JSON line (how the bounds are chosen)."""
    if os.environ.get("KERNELATTN_TRITON_ERRORS"):
        with open(os.environ["KERNELATTN_TRITON_ERRORS"], "a") as f:
            f.write(json.dumps({"case": case_id, **errs}) + "\n")
    for what, err in errs.items():
        bound = vanishing[dtype] if what.endswith("(vanishing)") else bounds[dtype][0 if what == "out" else 1]
        assert err < bound, f"{what}: relative RMS {err:.2e}, bound {bound:.0e}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
@interp
def test_triton_equals_torch_backend(case):
    check_bounds(errors(case), DTYPES[case[1]], _case_id(case))


# ---------------------------------------------------------------- compiled, on a GPU
#: maps whose estimate cancels (trigonometric features): with half inputs they run the float32
#: kernels (``mode_of``) and only the result is cast; at the GPU cases' sizes their float16
#: gradients overflow in both backends (70 % of ``dk`` in the torch backend for
#: trig-softmax-features, causal, d = 128), so float16 compares nothing there: their float32
#: and bfloat16 cases run the same kernels
CANCELLING = {"rff", "trig-softmax-features", "gmm-rks"}
GPU_CASES = [
    (m, dt, causal, d)
    for m in range(len(MAPS))
    for dt in range(3)
    for causal in (True, False)
    for d in (64, 128)
    if not (MAPS[m][0] in CANCELLING and DTYPES[dt] == torch.float16)
]
#: bounds of the compiled kernels at the GPU cases' sizes: the largest relative RMS measured on an
#: NVIDIA H200 (Triton 3.6, 2026-11-27), with margin: float32 1.1e-3 / 3.3e-3 (rff, causal,
#: d = 128: the estimate cancels; both sides IEEE float32, summed in other orders), bfloat16
#: 4.2e-3 / 5.0e-2, float16 3.1e-3 / 1.1e-2; hedgehog's vanishing log_scale 7.1e-6 / 0.34 / 0.39
GPU_BOUND = {torch.float32: (2e-3, 6e-3), torch.bfloat16: (1.5e-2, 1.5e-1), torch.float16: (5e-3, 2.5e-2)}
GPU_VANISHING = {torch.float32: 2e-5, torch.bfloat16: 0.5, torch.float16: 0.6}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "case", GPU_CASES, ids=[f"{_case_id((m, dt, c, True))[:-4]}-d{d}" for m, dt, c, d in GPU_CASES]
)
def test_compiled_kernels_equal_torch_backend_on_cuda(case):
    """The compiled kernels at the launch table's own tiles (chunks of 64), head widths 64
    and 128 with 128 features (the widths whose shared memory the compile test proves):
    ``N = 777`` (twelve full chunks and a partial one), left and right padding holding
    NaN, and, causal, a NaN future key; against the torch backend on the same GPU, within
    :data:`GPU_BOUND` (96 cases). Measured on an H200 with Triton 3.6 under the launch table
    before its sm_90 half entries were tuned; the tuned entries' results differ from those by
    4.4e-5 relative RMS (PRF, bfloat16, N = 16384), far inside the bounds."""
    m, dt, causal, d = case
    name, opts = MAPS[m]
    b, h, n = 2, 2, 777
    torch.manual_seed(m)
    est = FeatureMapAttention(name, num_features=128, head_dim=d, **opts).float().cuda()
    fused = est.feature_map.fused_spec() is not None
    g = torch.Generator(device="cuda").manual_seed(case[0] * 100 + dt)
    q, k, v = (0.7 * torch.randn(b, h, n, d, generator=g, device="cuda") for _ in range(3))
    mask = torch.zeros(b, n, dtype=torch.bool, device="cuda")
    mask[0, :50] = True  # left padding
    mask[1, 600:] = True  # right padding
    v[mask[:, None, :].expand(b, h, n)] = float("nan")
    if fused:
        k[mask[:, None, :].expand(b, h, n)] = float("nan")
    if causal:
        k[0, 1, 500, 3] = float("nan")
    errs = compare(est, *(t.to(DTYPES[dt]) for t in (q, k, v)), mask, causal)
    check_bounds(errs, DTYPES[dt], f"gpu-{MAPS[m][0]}-{DTYPES[dt]}-{causal}-d{d}", GPU_BOUND, GPU_VANISHING)
