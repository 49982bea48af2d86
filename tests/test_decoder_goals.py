"""scripts/decoder_goals.py measures what the issue's goals ask for: here its decoding
measurement on short contexts, for what does not depend on a quiet machine (the caches'
bytes). CI cost: about 10 s."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("transformers")


def test_decode_records_flat_state_memory_and_a_growing_kv_cache(script_module) -> None:  # type: ignore[no-untyped-def]
    goals = script_module("decoder_goals")
    sink: list[dict] = []
    args = argparse.Namespace(contexts=[80, 128], tokens=2, estimators=["prf", "sliding-window"])
    goals.run_decode(args, sink)
    assert len(sink) == 6 and all(r["tokens_per_s"] > 0 for r in sink)
    size = {(r["model"], r["context"]): r["cache_bytes"] for r in sink}
    original = "softmax (original, KV cache)"
    # the original's key-value cache: 4 layers x (keys + values) x 256 wide x float32 per position
    per_token = 4 * 2 * 256 * 4
    assert size[(original, 128)] - size[(original, 80)] == per_token * 48
    for name in ("prf", "sliding-window"):
        assert (
            size[(name, 80)] == size[(name, 128)] > 0
        )  # the same state whatever the context (beyond the window of 64)
        assert size[(name, 128)] < size[(original, 128)]
    for r in sink:  # each converted model's speed-up is over the original of its repeat and context
        if r["model"] != original:
            mine = next(o for o in sink if o["model"] == original and o["context"] == r["context"])
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / mine["tokens_per_s"])


def test_decode_repeats_end_with_medians(script_module) -> None:  # type: ignore[no-untyped-def]
    goals = script_module("decoder_goals")
    sink: list[dict] = []
    args = argparse.Namespace(contexts=[80], tokens=2, estimators=["prf"], repeats=3)
    goals.run_decode(args, sink)
    runs = [r for r in sink if r["measure"] == "decode"]
    summary = {r["model"]: r for r in sink if r["measure"] == "decode summary"}
    assert len(runs) == 6 and sorted({r["repeat"] for r in runs}) == [0, 1, 2] and len(summary) == 2
    ups = sorted(r["speedup"] for r in runs if r["model"] == "prf")
    assert summary["prf"]["speedup"] == ups[1] and summary["prf"]["speedup_min"] == ups[0]
    assert summary["prf"]["speedup_max"] == ups[2]
    speeds = sorted(r["tokens_per_s"] for r in runs if r["model"] == "prf")
    assert summary["prf"]["tokens_per_s"] == speeds[1]


def test_profile_counts_one_attention_call_per_layer_and_token(script_module) -> None:  # type: ignore[no-untyped-def]
    goals = script_module("decoder_goals")
    sink: list[dict] = []
    args = argparse.Namespace(context=24, tokens=3, top=400, estimators=["prf"])
    goals.run_profile(args, sink)
    calls = {r["function"].rsplit("(", 1)[-1].rstrip(")"): r["calls_per_token"] for r in sink}
    # the teacher's architecture has 4 layers: each generated token runs each layer's attention once
    assert calls["kernel_attention_forward"] == 4
    assert calls["attend"] == 4  # on the layer's decoding state (KernelStateLayer.attend), never recomputed
    assert all(0 < r["share"] <= 1 for r in sink)


def test_compile_floor_model_has_no_attention_and_trains(script_module) -> None:  # type: ignore[no-untyped-def]
    """``compile --estimators none``: the same model with each attention replaced by one
    linear map (the dense part of the step, which compiling does not speed up)."""
    import torch

    import kernelattn_core as ka

    goals = script_module("decoder_goals")
    floor, full = goals.TinyLM(goals.NO_ATTENTION, {}), goals.TinyLM("prf", {"num_features": 8})
    assert not any(isinstance(m, ka.KernelAttention) for m in floor.modules())
    assert sum(isinstance(m, ka.KernelAttention) for m in full.modules()) == 4
    loss = floor(torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0)))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in floor.parameters() if p.requires_grad)
