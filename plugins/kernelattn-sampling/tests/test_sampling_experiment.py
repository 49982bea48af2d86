"""The efficiency experiment (Table 6 at CPU scale), shrunk to run in a test."""

from __future__ import annotations

import json

from kernelattn_sampling.experiments import EfficiencyConfig, run_experiment

from kernelattn_core.toolkit import cli_main as main


def test_sampling_experiment_records_and_ratios() -> None:
    config = EfficiencyConfig(lengths=[64, 128], layers=1, embed=24, heads=3, samples=4, repeats=1, warmup=0)
    records = run_experiment(config)
    assert len(records) == 10  # 5 methods x 2 lengths
    for r in records:
        assert r["time_ms"] > 0 and r["peak_mb"] > 0
        if r["method"] == "softmax":
            assert r["time_ratio"] == 1.0 and r["mem_ratio"] == 1.0
    ra = {r["length"]: r["mem_ratio"] for r in records if r["method"] == "ra"}
    assert ra[128] > 1.0  # RA keeps two N x M matrices: more memory than softmax
    lara = {r["length"]: r["mem_ratio"] for r in records if r["method"] == "lara"}
    assert lara[128] < 1.0  # no N x M matrix: less memory than materialised softmax
    # the attention call alone: RA's N x M matrices above softmax's one, the linear ones far
    # below it (the whole stack's peak is the feed-forward block's for those)
    attn = {r["method"]: r["attn_mem_ratio"] for r in records if r["length"] == 128}
    assert attn["softmax"] == 1.0 and attn["ra"] > 1.0
    assert attn["performer"] < 0.5 and attn["lara"] < 0.5


def test_sampling_experiment_cli(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["experiment", "lara-efficiency", "--lengths", "32", "--layers", "1", "--embed", "12", "--heads", "3"]
    assert main([*argv, "--samples", "2", "--repeats", "1", "--warmup", "0", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["method"] for r in out["records"]} == {"softmax", "sdpa", "performer", "lara", "ra"}
