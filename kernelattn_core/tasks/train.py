"""Training one model on one task with one estimator, and what it learned.

Every estimator of a task gets the same recipe (:class:`TrainConfig`): the same model
sizes, the same optimiser (AdamW, :math:`\\beta = (0.9, 0.98)`, weight decay 0.1, gradient
norm clipped at 1), the same schedule (linear warm-up over the first 10 % of the steps,
then cosine decay to 0), the same number of steps and the same batches (the training
stream is seeded by the run's seed alone). The evaluation set is drawn from a separate
stream (:data:`~kernelattn_core.tasks.base.EVAL_SEED_OFFSET`) and never trained on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..validation import check_positive_finite, check_positive_int
from .base import EVAL_SEED_OFFSET, IGNORE, Task, TaskBatch
from .model import TaskModel


@dataclass(frozen=True)
class TrainConfig:
    """The training recipe of one task at one scale (identical for every estimator).

    Attributes
    ----------
    steps : int
        Optimiser steps.
    batch_size : int
    lr : float
        Peak learning rate.
    d_model, num_heads, num_layers : int
        Model sizes (:class:`~kernelattn_core.tasks.model.TaskModel`).
    eval_size : int
        Held-out examples of the final evaluation.
    eval_every : int
        Steps between the evaluations of the learning curve (on the first
        ``curve_size`` held-out examples); the curve gives the steps to 90 % of the ceiling.
    curve_size : int
    """

    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    d_model: int = 64
    num_heads: int = 2
    num_layers: int = 2
    eval_size: int = 512
    eval_every: int = 100
    curve_size: int = 128

    def updated(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied (``None`` values ignored), each checked: a field
        of this class, an integer >= 1 (``lr``: a finite number > 0)."""
        names = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise InputError(f"recipe: unknown field(s) {unknown}; the fields are {sorted(names)}")
        changes = {k: v for k, v in changes.items() if v is not None}
        for key, value in changes.items():
            if key == "lr":
                check_positive_finite(key, value)
            else:
                check_positive_int(key, value)
        return replace(self, **changes)


def lr_factor(step: int, total: int, warmup_fraction: float = 0.1) -> float:
    """Linear warm-up over ``warmup_fraction`` of the steps, then cosine decay to 0."""
    warmup = max(1, round(warmup_fraction * total))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def loss_and_hits(
    model: TaskModel, batch: TaskBatch, forward: Callable[..., torch.Tensor] | None = None
) -> tuple[torch.Tensor, int, int]:
    """Cross-entropy over the scored positions (or labels), and the (correct, scored) counts.

    ``forward`` (default: ``model`` itself) computes the logits: the compiled model when
    training with ``compile``. Either runs its head at the scored positions only; the
    compiled one gets them as indices found outside it (a boolean selection inside would
    have a data-dependent size and split its graph)."""
    if model.kind == "lm":
        assert batch.targets is not None
        scored = batch.targets != IGNORE  # [B, N]
        if forward is None or forward is model:
            flat = model(batch.inputs, batch.padding, scored)  # [S, V]
        else:
            flat = forward(batch.inputs, batch.padding, scored.flatten().nonzero().squeeze(1))  # [S, V]
        target = batch.targets[scored]  # [S]
    else:
        assert batch.labels is not None
        flat, target = (model if forward is None else forward)(batch.inputs, batch.padding), batch.labels
    loss = F.cross_entropy(flat, target)
    hits = int((flat.detach().argmax(-1) == target).sum())
    return loss, hits, int(target.numel())


@torch.no_grad()
def accuracy(model: TaskModel, batches: list[TaskBatch]) -> float:
    """Accuracy over every scored position (or label) of ``batches``, in eval mode."""
    was = model.training
    model.eval()
    hits = total = 0
    for b in batches:
        _, h, t = loss_and_hits(model, b)
        hits, total = hits + h, total + t
    model.train(was)
    return hits / max(total, 1)


def eval_batches(
    task: Task, scale: str, seed: int, size: int, batch_size: int, device: torch.device | None = None
) -> list[TaskBatch]:
    """The held-out set: ``size`` examples from the evaluation stream of ``seed`` (drawn on
    the CPU, then moved to ``device``)."""
    g = torch.Generator().manual_seed(seed + EVAL_SEED_OFFSET)
    out, left = [], size
    while left > 0:
        n = min(batch_size, left)
        out.append(to_device(task.batch(n, scale=scale, generator=g), device))
        left -= n
    return out


def to_device(batch: TaskBatch, device: torch.device | None) -> TaskBatch:
    """``batch`` with its tensors on ``device`` (``None``: as it is)."""
    if device is None or batch.inputs.device == device:
        return batch
    parts = {f.name: getattr(batch, f.name) for f in fields(batch)}
    return TaskBatch(**{k: None if t is None else t.to(device) for k, t in parts.items()})


def build_model(
    task: Task, estimator: str, config: TrainConfig, scale: str, seed: int, options: dict[str, Any]
) -> TaskModel:
    """The task's model with ``estimator``, parameters drawn from ``torch.manual_seed(seed)``."""
    tc = task.config(scale)
    torch.manual_seed(seed)
    return TaskModel(
        tc.vocab_size,
        tc.seq_len,
        task.kind,
        estimator,
        num_classes=tc.num_classes,
        d_model=config.d_model,
        num_heads=config.num_heads,
        num_layers=config.num_layers,
        **options,
    )


def train(
    task: Task,
    estimator: str,
    config: TrainConfig,
    *,
    scale: str = "quick",
    seed: int = 0,
    options: dict[str, Any] | None = None,
    on_step: Callable[[int], None] | None = None,
    device: str | torch.device | None = None,
    compile: bool | str = False,
) -> dict[str, Any]:
    """Train a fresh model with ``estimator`` on ``task`` and measure what it learned.

    Parameters
    ----------
    task : Task
    estimator : str
        Registry name, or :data:`~kernelattn_core.tasks.model.NO_MIXING`.
    config : TrainConfig
    scale : {"quick", "paper"}
    seed : int
        Seeds the data stream, the evaluation stream and the parameters.
    options : dict, optional
        Estimator options (``num_features``, ...).
    on_step : callable, optional
        Called with the step index after each step (progress).
    device : str or torch.device, optional
        Where the model trains (``"cpu"``, the default, ``"cuda"``, ``"cuda:1"``). The
        parameters are drawn on the CPU and the batches generated there, then moved: a seed
        gives the same initial model and data on every device (the trained models differ by
        the devices' rounding).
    compile : bool or str
        Train through ``torch.compile(model, backend=...)``: ``True`` for Inductor, or the
        name of another ``torch.compile`` backend (``"aot_eager"``: tracing without code
        generation). Graph breaks are allowed. The first step pays the compilation
        (``first_step_s``; with Inductor 10-40 s cold on a 2-core CPU, a few seconds when
        its on-disk cache holds the kernels); the evaluations and the peak-memory step run
        the eager model. Same recipe and data; the results differ from an eager run by
        rounding, and where the estimator draws random numbers inside the step, by the
        draws (Inductor has its own generator).

    Returns
    -------
    dict
        ``accuracy`` (held-out, final), ``curve`` (``[(step, accuracy), ...]`` on the first
        ``curve_size`` held-out examples), ``losses`` (training loss every ``eval_every``
        steps), ``first_loss`` / ``last_loss`` (means over the first and last 10 % of the
        steps), ``time_per_step_ms`` (median), ``first_step_s`` (the first step, compilation
        included), ``peak_mem_mb`` (peak tensor memory of one eager training step),
        ``train_s``, ``params``, ``device`` and ``compiled``.
    """
    from ..validation import check_device

    options = dict(options or {})
    where = check_device("device", "cpu" if device is None else device)
    backend = compile_backend(compile)
    model = build_model(task, estimator, config, scale, seed, options).to(where)
    model.train()
    forward = model if backend is None else torch.compile(model, backend=backend)
    sync = (lambda: torch.cuda.synchronize(where)) if where.type == "cuda" else (lambda: None)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, config.steps))
    data = torch.Generator().manual_seed(seed)
    held_out = eval_batches(task, scale, seed, config.eval_size, max(config.batch_size, 64), where)
    curve_set = eval_batches(task, scale, seed, config.curve_size, config.curve_size, where)

    def step(batch: TaskBatch) -> float:
        loss, _, _ = loss_and_hits(model, batch, forward)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss is {float(loss)} (non-finite)")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        return float(loss.detach())

    losses: list[float] = []
    curve: list[tuple[int, float]] = []
    times: list[float] = []
    start = time.perf_counter()
    for i in range(config.steps):
        batch = to_device(task.batch(config.batch_size, scale=scale, generator=data), where)
        sync()
        t0 = time.perf_counter()
        losses.append(step(batch))  # float(loss) waits for the device
        times.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step(i)
        if (i + 1) % config.eval_every == 0 or i + 1 == config.steps:
            curve.append((i + 1, accuracy(model, curve_set)))
    train_s = time.perf_counter() - start
    peak = _step_peak_memory(model, to_device(task.batch(config.batch_size, scale=scale, generator=data), where))
    tenth = max(1, config.steps // 10)
    first = times[0]
    times.sort()
    return {
        "accuracy": accuracy(model, held_out),
        "curve": curve,
        "losses": [
            sum(losses[j : j + config.eval_every]) / len(losses[j : j + config.eval_every])
            for j in range(0, len(losses), config.eval_every)
        ],
        "first_loss": sum(losses[:tenth]) / tenth,
        "last_loss": sum(losses[-tenth:]) / tenth,
        "time_per_step_ms": 1e3 * times[len(times) // 2],
        "first_step_s": first,
        "peak_mem_mb": peak / 2**20,
        "train_s": train_s,
        "params": sum(p.numel() for p in model.parameters()),
        "config": asdict(config),
        "device": str(where),
        "compiled": backend or False,
    }


def compile_backend(compile: object, name: str = "compile") -> str | None:
    """The ``torch.compile`` backend that ``compile`` asks for (``None``: eager): ``True``
    is ``"inductor"``; a string names a backend, checked against
    :func:`torch._dynamo.list_backends`. Errors name the argument ``name``."""
    if compile is False:
        return None
    if compile is True:
        return "inductor"
    if isinstance(compile, str):
        import torch._dynamo

        known = sorted(torch._dynamo.list_backends(exclude_tags=()))
        if compile not in known:
            raise InputError(f"{name}: expected True, False or a torch.compile backend {known}, got {compile!r}")
        return compile
    raise InputError(f"{name}: expected True, False or a backend name, got {compile!r} ({type(compile).__name__})")


def _step_peak_memory(model: TaskModel, batch: TaskBatch) -> int:
    """Peak tensor memory (bytes) of one forward and backward pass (gradients discarded)."""
    from ..report.measure import peak_memory

    def once() -> None:
        loss, _, _ = loss_and_hits(model, batch)
        loss.backward()

    out = peak_memory(once, batch.inputs.device)
    model.zero_grad(set_to_none=True)
    return out


def steps_to_fraction(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first step of ``curve`` whose accuracy reaches ``target`` (``None`` if never)."""
    for step_index, acc in curve:
        if acc >= target:
            return step_index
    return None


__all__ = ["TrainConfig", "accuracy", "compile_backend", "lr_factor", "steps_to_fraction", "to_device", "train"]
