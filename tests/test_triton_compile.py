"""Every kernel configuration the Triton backend can launch fits ``sm_80`` and ``sm_90``.

CPU only, no GPU: the backend's host code runs for every entry of the launch table
(:mod:`kernelattn_core.engine.triton_config`, keyed by ``(arch, d, D, dtype)``) and
every way the features reach the kernels, forward, backward and decoding, recording its
launches (:mod:`kernelattn_core.engine.triton_resources`); each distinct compiled
configuration is compiled by Triton's own compiler for ``GPUTarget("cuda", 80 | 90,
32)`` with the bundled ``ptxas``, in one worker process per CPU, and

* its shared memory (the compiler's allocation, which a launch checks against the
  device: the A100's 163 KiB, the H100's 227 KiB) must fit, and
* ``ptxas -v`` must report no more spill stores than
  :func:`~kernelattn_core.engine.triton_config.spill_limit` allows: 0 bytes, except in
  the entries chosen by timing on a GPU (``sm_90`` half: 1024 bytes, where the spilling
  candidates were the faster);
* negative controls: the same check with a limit just below the largest measurement
  catches exactly those configurations, and a real compile with one warp spills;
* every table key is driven, and shapes beyond the table (``d``, ``D`` above 256) launch
  no configuration the table's do not (the kernels loop over ``D`` and ``d'``);
* ``docs/_generated/triton_resources.inc`` (included by ``docs/backends.rst``) is the
  table these measurements render, for the Triton version it names
  (``KERNELATTN_WRITE_RESOURCES=1`` rewrites it).

Measurements are cached in pytest's cache by a hash of the kernels' source, the unit
and Triton's version, so only a changed kernel is compiled again; a fresh clone (CI)
compiles all (112 configurations).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("triton")

from kernelattn_core.engine import triton_config as C
from kernelattn_core.engine import triton_resources as R

CACHE_KEY = "kernelattn/triton-resources"


@pytest.fixture(scope="module")
def beyond():
    """The units of the shapes beyond the table (they must be among the table's)."""
    return R.launch_units(shapes=R.BEYOND)[0]


@pytest.fixture(scope="module")
def measured(request: pytest.FixtureRequest):
    units, driven = R.launch_units(shapes=[(d, f) for d in C.DIMS for f in C.DIMS])
    store = getattr(request.config, "cache", None)  # absent with -p no:cacheprovider
    cache = store.get(CACHE_KEY, {}) if store is not None else {}
    results = R.measure(units, cache=cache)
    if store is not None:
        store.set(CACHE_KEY, {key: results[key] for key in units})
    return units, driven, R.rows(units, results)


def test_every_table_entry_and_kernel_is_compiled(measured):
    units, driven, _ = measured
    assert all(dict((n, v) for n, _, v in u.constexprs)["EMU"] == 0 for u in units.values()), "interpreter-only code"
    assert driven == set(C.TABLE), f"table keys never launched: {sorted(set(C.TABLE) - driven)[:5]}"
    seen = {(u.arch, u.dtype, u.name, u.feat) for u in units.values()}
    for arch in C.ARCHS:
        for name in C.KERNEL_NAMES:
            for feat in C.FEATURE_KINDS:  # plain maps run the float32 entry (any input dtype)
                dtypes = C.DTYPES if feat in (1, 2) else ("float32",)
                for dtype in dtypes:
                    assert (arch, dtype, name, feat) in seen, (arch, dtype, name, feat)


def over_limits(table: list[dict], shared: dict[int, int], spills=C.spill_limit) -> list[dict]:  # type: ignore[no-untyped-def]
    """The rows whose shared memory exceeds ``shared[arch]`` or whose spill stores exceed
    ``spills(arch, dtype)``."""
    return [r for r in table if r["shared"] > shared[r["arch"]] or r["spill_stores"] > spills(r["arch"], r["dtype"])]


def test_shared_memory_and_spills_within_the_limits(measured):
    *_, table = measured
    over = over_limits(table, C.SHARED_LIMIT)
    assert not over, f"{len(over)} configurations over a limit:\n" + "\n".join(map(str, over[:20]))


def test_sm80_entries_fit_the_consumer_parts(measured):
    """Devices of compute capability 8.6, 8.9 and 12.x (99 KiB per block) run the sm_80
    entries (:func:`~kernelattn_core.engine.triton_config.arch_of`): they fit there too."""
    *_, table = measured
    assert max(r["shared"] for r in table if r["arch"] == 80) <= C.SHARED_LIMIT_SMALL


def test_negative_control_the_check_catches_a_lower_limit(measured):
    """The same check with each architecture's limit 1 byte below its largest measured
    shared memory reports exactly the configurations at that largest value."""
    *_, table = measured
    top = {arch: max(r["shared"] for r in table if r["arch"] == arch) for arch in C.ARCHS}
    over = over_limits(table, {arch: top[arch] - 1 for arch in C.ARCHS})
    assert over and all(r["shared"] == top[r["arch"]] for r in over)


def test_negative_control_a_spilling_configuration_is_caught():
    """A real compile that spills beyond even the allowance of the GPU-measured entries:
    their query-gradient kernel with one warp instead of four (3148 bytes of spill stores
    with Triton 3.9); and one spilled byte in an entry that allows none."""
    units, _ = R.launch_units(archs=(90,), shapes=[(64, 64)], dtypes=("bfloat16",), feats=(1,))
    unit = next(u for u in units.values() if u.name == "bwd_dq")
    res = R.measure({"one warp": dataclasses.replace(unit, num_warps=1)}, workers=1)["one warp"]
    row = {"arch": 90, "dtype": unit.dtype, **res}
    assert C.spill_limit(90, "bfloat16") == C.MEASURED_SPILL_BYTES
    assert over_limits([row], C.SHARED_LIMIT) == [row]
    unmeasured = {**row, "dtype": "float32", "spill_stores": 1}
    assert over_limits([unmeasured], C.SHARED_LIMIT) == [unmeasured]


def test_shapes_beyond_the_table_launch_no_new_configuration(measured, beyond):
    units, *_ = measured
    assert beyond, "nothing was launched"
    assert set(beyond) <= set(units), "a shape beyond the table launched a configuration no entry covers"


def test_docs_show_the_measured_table(measured):
    *_, table = measured
    text = R.render(table)
    # the checkout's file (R.TABLE_FILE points into site-packages when the core is not installed editable, as in CI)
    table_file = Path(__file__).resolve().parents[1] / "docs" / "_generated" / R.TABLE_FILE.name
    if os.environ.get("KERNELATTN_WRITE_RESOURCES") == "1":
        table_file.parent.mkdir(parents=True, exist_ok=True)
        table_file.write_text(text)
    committed = table_file.read_text()
    version = re.search(r"Measured with Triton (\S+)", committed)
    assert version is not None, f"{table_file}: no Triton version in it"
    if version.group(1) != R._triton_version():
        pytest.skip(
            f"{table_file.name} was measured with Triton {version.group(1)}, this is {R._triton_version()}: "
            "the limits above are checked; rewrite the table with KERNELATTN_WRITE_RESOURCES=1"
        )
    assert committed == text, (
        f"{table_file} is not what the compile test measures; rewrite it with KERNELATTN_WRITE_RESOURCES=1"
    )
