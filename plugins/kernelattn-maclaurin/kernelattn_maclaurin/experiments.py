"""The papers' RMFA experiments, as ``kernelattn experiment rmfa-error`` and ``rmfa-speed``.

* ``rmfa-error`` (SchoenbAt Fig. 4): :math:`Q, K, V \\sim \\mathcal{N}(0, 1)^{n \\times d}`,
  ppSBN pre-scaling (:math:`\\gamma = \\beta = 1`, the "ideal" post-scaling for this
  target), RMFA against exact kernelized attention on the same pre-scaled inputs;
  mean absolute error over the entries, then its mean and median over repeats.
  Defaults: :math:`n = 100`, :math:`d \\in \\{10, 50, 200\\}`,
  :math:`D \\in \\{10, 30, 50, 128\\}`, 100 repeats, every kernel of the plugin.
* ``rmfa-speed`` (SchoenbAt Fig. 5): time of exact kernelized attention over time of
  RMFA, :math:`d = 50`, 8 heads, sequence length 1000 to 5000, :math:`D` from 2 to 120,
  on unit-norm rows (so that every kernel is in its domain).

Both print a table (or CSV / JSON, ``--format``, ``--output FILE``), draw the paper's
figure with ``--plot FILE`` (error against :math:`D`, one panel per :math:`d`; speed-up
against :math:`D`, one panel per kernel, a line per length) and take options to shrink
the grid.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from kernelattn_core import ExactAttention
from kernelattn_core.toolkit import Experiment, add_output_arguments, check_plot, median_time, write_results

from .estimators import RMFA
from .feature_maps import RandomMaclaurinFeatures
from .naive import kernelized_attention_naive
from .normalizers import PPSBN

ALL_KERNELS = ("exp", "inv", "logi", "trigh", "sqrt", "polynomial")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kernels", nargs="+", default=list(ALL_KERNELS), metavar="K", help="kernel names")
    parser.add_argument("--mode", choices=("paper", "released"), default="paper", help="rmf mode")
    parser.add_argument("--p", type=float, default=2.0, help="degree-law ratio p > 1")
    parser.add_argument("--seed", type=int, default=0)
    add_output_arguments(parser)


def error_figure(records: list[dict[str, Any]], path: Any) -> None:
    """SchoenbAt Fig. 4: mean absolute error against D, one panel per d, a line per kernel."""
    from kernelattn_core.toolkit import line_panels

    line_panels(
        records, path, panel="d", group="kernel", x="D", y="mean_abs_err", xlabel="D (random features)",
        ylabel="mean absolute error", title="RMFA approximation error (SchoenbAt Fig. 4)", logy=True,
    )  # fmt: skip


def speed_figure(records: list[dict[str, Any]], path: Any) -> None:
    """SchoenbAt Fig. 5: speed-up of RMFA over exact attention against D, a panel per kernel, a line per L."""
    from kernelattn_core.toolkit import line_panels

    line_panels(
        records, path, panel="kernel", group="L", x="D", y="speedup", xlabel="D (random features)",
        ylabel="time exact / time RMFA", title="RMFA speed-up (SchoenbAt Fig. 5)",
    )  # fmt: skip


# --------------------------------------------------------------------------- approximation error
def error_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=100, help="sequence length (100)")
    parser.add_argument("--dims", nargs="+", type=int, default=[10, 50, 200], metavar="d")
    parser.add_argument("--budgets", nargs="+", type=int, default=[10, 30, 50, 128], metavar="D")
    parser.add_argument("--repeats", type=int, default=100)
    _common(parser)


def rmfa_error(
    *,
    n: int = 100,
    dims: tuple[int, ...] = (10, 50, 200),
    budgets: tuple[int, ...] = (10, 30, 50, 128),
    repeats: int = 100,
    kernels: tuple[str, ...] = ALL_KERNELS,
    mode: str = "paper",
    p: float = 2.0,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One record per (kernel, d, D): mean and median over repeats of the mean absolute
    error of RMFA against exact kernelized attention on ppSBN-pre-scaled inputs."""
    records = []
    for d in dims:
        data_gen = torch.Generator().manual_seed(1_000_003 * seed + d)
        data = [
            tuple(torch.randn(1, 1, n, d, generator=data_gen, dtype=torch.float64) for _ in range(3))
            for _ in range(repeats)
        ]
        pre = PPSBN(power=False)
        scaled = [pre.pre(q, k) for q, k, _ in data]  # rows of norm d^(-1/4), as RMFA's features see them
        for name in kernels:
            fm_probe = RandomMaclaurinFeatures(num_features=max(budgets[0], 2), kernel=name)
            f = fm_probe.target.f
            exact = [kernelized_attention_naive(qs, ks, v, f) for (qs, ks), (_, _, v) in zip(scaled, data)]
            for budget in budgets:
                fm = RandomMaclaurinFeatures(num_features=budget, kernel=name, p=p, mode=mode).double()
                est = RMFA(fm, PPSBN(power=False)).double()
                errors = []
                for r, ((q, k, v), ref) in enumerate(zip(data, exact)):
                    g = torch.Generator().manual_seed(((seed * 7919 + d) * 104_729 + budget) * 1_000_003 + r)
                    if fm.built:
                        fm.redraw(generator=g)
                    else:
                        fm.build(d, generator=g)
                    with torch.no_grad():
                        out = est(q, k, v)
                    errors.append(float((out - ref).abs().mean()))
                records.append(
                    {
                        "kernel": name,
                        "d": d,
                        "D": budget,
                        "mean_abs_err": sum(errors) / len(errors),
                        "median_abs_err": statistics.median(errors),
                        "repeats": repeats,
                    }
                )
    return records


def error_run(args: argparse.Namespace) -> int:
    check_plot(args)
    records = rmfa_error(
        n=args.n,
        dims=tuple(args.dims),
        budgets=tuple(args.budgets),
        repeats=args.repeats,
        kernels=tuple(args.kernels),
        mode=args.mode,
        p=args.p,
        seed=args.seed,
    )
    columns = ("kernel", "d", "D", "mean_abs_err", "median_abs_err", "repeats")
    write_results(args, records, columns, figure=error_figure)
    return 0


# --------------------------------------------------------------------------- speed-up
def speed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", nargs="+", type=int, default=[1000, 2000, 3000, 4000, 5000], metavar="L")
    parser.add_argument("--budgets", nargs="+", type=int, default=[2, 10, 30, 60, 90, 120], metavar="D")
    parser.add_argument("--head-dim", type=int, default=50)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed calls per cell, at least (median of blocked_autorange)"
    )
    parser.add_argument("--device", default="cpu")
    _common(parser)


def rmfa_speed(
    *,
    lengths: tuple[int, ...] = (1000, 2000, 3000, 4000, 5000),
    budgets: tuple[int, ...] = (2, 10, 30, 60, 90, 120),
    head_dim: int = 50,
    heads: int = 8,
    batch: int = 1,
    repeats: int = 3,
    kernels: tuple[str, ...] = ALL_KERNELS,
    mode: str = "paper",
    p: float = 2.0,
    seed: int = 0,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """One record per (kernel, L, D): median forward times of exact kernelized attention
    and of RMFA (float32, no grad) and their ratio ``speedup = exact / rmfa``."""
    dev = torch.device(device)
    records = []
    for length in lengths:
        g = torch.Generator().manual_seed(seed + length)
        shape = (batch, heads, length, head_dim)
        q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
        q = torch.nn.functional.normalize(q - q.mean(-1, keepdim=True), dim=-1).to(dev)  # unit rows: in every domain
        k = torch.nn.functional.normalize(k - k.mean(-1, keepdim=True), dim=-1).to(dev)
        v = v.to(dev)
        for name in kernels:
            exact = ExactAttention(name).to(dev)
            with torch.no_grad():
                t_exact = median_time(lambda exact=exact, q=q, k=k, v=v: exact(q, k, v), dev, repeats)
            for budget in budgets:
                if mode == "released" and budget < 2:
                    continue
                est = RMFA(num_features=budget, kernel=name, p=p, mode=mode, seed=seed, head_dim=head_dim).to(dev)
                with torch.no_grad():
                    t_rmfa = median_time(lambda est=est, q=q, k=k, v=v: est(q, k, v), dev, repeats)
                records.append(
                    {
                        "kernel": name,
                        "L": length,
                        "D": budget,
                        "exact_ms": 1e3 * t_exact,
                        "rmfa_ms": 1e3 * t_rmfa,
                        "speedup": t_exact / t_rmfa,
                    }
                )
    return records


def speed_run(args: argparse.Namespace) -> int:
    check_plot(args)
    records = rmfa_speed(
        lengths=tuple(args.lengths),
        budgets=tuple(args.budgets),
        head_dim=args.head_dim,
        heads=args.heads,
        batch=args.batch,
        repeats=args.repeats,
        kernels=tuple(args.kernels),
        mode=args.mode,
        p=args.p,
        seed=args.seed,
        device=args.device,
    )
    columns = ("kernel", "L", "D", "exact_ms", "rmfa_ms", "speedup")
    write_results(args, records, columns, figure=speed_figure)
    return 0


EXPERIMENTS = (
    Experiment(
        "rmfa-error",
        "RMFA approximation error vs exact kernelized attention (SchoenbAt Fig. 4)",
        error_arguments,
        error_run,
    ),
    Experiment(
        "rmfa-speed",
        "speed-up of RMFA over exact kernelized attention (SchoenbAt Fig. 5)",
        speed_arguments,
        speed_run,
    ),
)
