"""The CEXP experiment (spec 004 §4): ordering variance-adjusted < means-only < PRF, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from kernelattn_prf.experiments import CexpConfig, make_dataset, run_experiment, summary_records

from kernelattn_core.toolkit import cli_main as main

SMALL = CexpConfig(datasets=5, pairs=100, num_features=256, seed=0)


def _medians(config: CexpConfig) -> dict[str, dict[str, float]]:
    return {r["estimator"]: r for r in summary_records(run_experiment(config))}  # type: ignore[misc]


def test_prf_experiment_ordering_variance_lt_means_lt_prf() -> None:
    """Rate reading (default): the paper's ordering on both metrics (checked robust over 12 seeds)."""
    s = _medians(SMALL)
    for metric in ("mse_median", "max_rel_median"):
        assert s["cexp-variance"][metric] < s["cexp-means"][metric] < s["prf"][metric], metric
    assert s["cexp-variance"]["mse_median"] < 0.1 * s["cexp-means"]["mse_median"]


def test_prf_experiment_scale_reading_makes_the_rules_coincide() -> None:
    """Literal scale-50 reading: means dominate variances, so the two rules give ~ the same A
    (why the rate reading is the default)."""
    s = _medians(CexpConfig(datasets=3, pairs=100, num_features=256, laplace="scale", seed=1))
    ratio = s["cexp-variance"]["mse_median"] / s["cexp-means"]["mse_median"]
    assert ratio == pytest.approx(1.0, abs=0.02)


def test_prf_experiment_dataset_matches_the_setup() -> None:
    x, y = make_dataset(CexpConfig(pairs=250), torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (250, 50) and x.dtype == torch.float64
    assert float(x.norm(dim=-1).mean()) == pytest.approx(5.0, rel=1e-12)
    assert float(y.norm(dim=-1).mean()) == pytest.approx(0.5, rel=1e-12)
    assert CexpConfig().laplace_scale == pytest.approx(0.02) and CexpConfig(laplace="scale").laplace_scale == 50.0


def test_prf_experiment_cli(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["experiment", "cexp", "--datasets", "2", "--pairs", "40", "--num-features", "64", "--include-full"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    for name in ("prf", "cexp-means", "cexp-variance", "cexp-full", "mse_median", "max_rel_q3"):
        assert name in text
    assert main([*argv, "--format", "json", "--variant", "plain"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["variant"] == "plain" and len(data["per_dataset"]["prf"]["mse"]) == 2
