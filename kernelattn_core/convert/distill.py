"""Fit the learnable parameters of converted attention layers to the teacher's softmax.

Every estimator is linear in the values, so its attention rows are the output for
one-hot values: :math:`\\hat P = \\mathrm{est}(Q, K, I_M)` (``[B, H, N, M]``), whatever
the estimator (:meth:`~kernelattn_core.interfaces.AttentionEstimator.attention_rows`,
which estimators that can form the rows directly override). The teacher's rows are
:math:`P = \\mathrm{softmax}(s\\,QK^\\top)` over the allowed keys, with the scale :math:`s`
the teacher's layer applies (:math:`1/\\sqrt d` unless the module scales otherwise, as
GPT-2's ``scale_attn_by_inverse_layer_idx`` or Gemma's ``query_pre_attn_scalar`` do;
conversion records it in the estimator). Losses (per query row, averaged):

* ``"ce"``: cross-entropy :math:`-\\sum_j P_{ij} \\log \\max(\\hat P_{ij}, \\epsilon)`,
  reported as the KL divergence :math:`\\mathrm{KL}(P \\| \\hat P)` (the same gradient);
* ``"mse"``: relative output error :math:`\\|\\hat o - o\\|^2 / \\|o\\|^2` with
  :math:`o = PV`, :math:`\\hat o = \\mathrm{est}(Q, K, V)`.

Layers are fitted independently: each layer's ``q, k, v`` come from the *teacher* on
the same inputs (captured once, with forward pre-hooks), so an error in layer ``i``
does not move the target of layer ``i + 1``. Only the estimator's parameters are
trained (Adam); the projections stay the teacher's. Random draws are frozen during
fitting (the estimator runs in eval mode), so a fixed ``seed`` gives the same fit.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from ..module import zero_padded
from ..validation import check_choice, check_positive_int

_EPS = 1e-12


@dataclass
class LayerReport:
    """The fit of one converted layer.

    Attributes
    ----------
    layer : int
    name : str
        Module name in the model.
    parameters : int
        Number of trained scalars (0: nothing to fit; only calibration, if any, ran).
    loss_before, loss_after : float
        The loss (KL for ``"ce"``, relative squared error for ``"mse"``) over every
        query row of the fitting data, before and after.
    error_before, error_after : float
        Output relative error :math:`\\|\\hat o - o\\|_F / \\|o\\|_F` on the fitting data.
    seconds : float
    restored : bool
        The fit made the loss worse (a diverging signed estimator), so the
        parameters it started from were put back (``loss_after == loss_before``).
    """

    layer: int
    name: str
    parameters: int
    loss_before: float
    loss_after: float
    error_before: float
    error_after: float
    seconds: float
    restored: bool = False


@dataclass
class DistillReport:
    """What :func:`distill_attention` did: one :class:`LayerReport` per layer, and, when
    evaluation texts were given, one
    :class:`~kernelattn_core.convert.report.EmbeddingReport` per text (embedding cosine
    by length bucket and on 128/512-token passages, nearest-neighbour agreement,
    Spearman correlation of the similarity matrices)."""

    loss: str
    steps: int
    layers: list[LayerReport] = field(default_factory=list)
    seconds: float = 0.0
    embeddings: list[Any] = field(default_factory=list)

    def records(self) -> list[dict[str, Any]]:
        """One dict per layer (for tables and JSON)."""
        return [asdict(r) for r in self.layers]


@dataclass
class _Layer:
    q: list[torch.Tensor]  # each [1, H, N, d]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    kpm: list[torch.Tensor | None]  # each [1, N] bool
    causal: bool
    scale: float | None = None  # the logits' factor (None: 1 / sqrt(d)), the converted estimator's


def _batches(batches: Any) -> list[Any]:
    if isinstance(batches, dict | torch.Tensor):
        return [batches]
    return list(batches)


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, tuple | list):
        return model(*batch)
    return model(batch)


_DROP = ("need_weights", "output_attentions", "average_attn_weights")


@torch.no_grad()
def capture_layers(student: nn.Module, teacher: nn.Module, batches: Iterable[Any]) -> dict[str, _Layer]:
    """Per converted layer of ``student``: the ``q, k, v`` and masks the *teacher's*
    module of the same name sees on ``batches`` (projected by the student's module,
    whose projections are the teacher's)."""
    from .attention import converted_modules

    modules = converted_modules(student)
    if not modules:
        raise InputError("student: no converted attention layer (use convert_attention first)")
    seen: dict[str, list[tuple[tuple, dict]]] = {name: [] for name, _ in modules}
    handles = []
    for name, _ in modules:
        try:
            target = teacher.get_submodule(name)
        except AttributeError as err:
            raise InputError(f"teacher: has no module {name!r}; pass the model that was converted") from err

        def hook(_m: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            seen[name].append((args, {k: v for k, v in kwargs.items() if k not in _DROP}))

        handles.append(target.register_forward_pre_hook(hook, with_kwargs=True))
    was_training = teacher.training
    teacher.eval()
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        for batch in _batches(batches):
            _call(teacher, batch)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
        teacher.train(was_training)
        for h in handles:
            h.remove()
    out = {}
    for name, module in modules:
        if not seen[name]:
            raise InputError(f"teacher: module {name!r} was never called on the batches")
        layer = _Layer([], [], [], [], False, scale=_scale(module.estimator))
        for args, kwargs in seen[name]:
            q, k, v, kpm, causal = module.attention_inputs(*args, **kwargs)
            # no value at a padded key may reach the teacher's output through a zero weight:
            # the teacher leaves NaN there after a fully masked row of its own softmax
            k, v = zero_padded(k, v, kpm)
            layer.causal = causal
            for b in range(q.shape[0]):
                layer.q.append(q[b : b + 1])
                layer.k.append(k[b : b + 1])
                layer.v.append(v[b : b + 1])
                layer.kpm.append(None if kpm is None else kpm[b : b + 1])
        out[name] = layer
    return out


def _scale(estimator: nn.Module) -> float | None:
    """The factor of the attention logits the converted ``estimator`` applies, which
    conversion took from the module (``None``: the default :math:`1/\\sqrt d`)."""
    scale = getattr(estimator, "scale", None)
    return None if isinstance(scale, bool) or not isinstance(scale, int | float) else float(scale)


def _teacher_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    kpm: torch.Tensor | None,
    causal: bool,
    rows: Any,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention rows ``[1, H, R, M]`` of the queries ``rows``, the logits
    scaled by ``scale`` (``None``: :math:`1/\\sqrt d`), as the teacher's layer scales
    them (GPT-2's ``scale_attn_by_inverse_layer_idx``, Gemma's
    ``query_pre_attn_scalar``, ...)."""
    factor = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = (q[:, :, rows] @ k.transpose(-1, -2)) * factor  # [1, H, R, M]
    if kpm is not None:
        logits = logits.masked_fill(kpm[:, None, None, :], float("-inf"))
    if causal:
        n = q.shape[2]
        idx = torch.arange(n, device=q.device)[rows]
        logits = logits.masked_fill(torch.arange(k.shape[2], device=q.device)[None, :] > idx[:, None], float("-inf"))
    return torch.softmax(logits, -1)


def _student_rows(est: nn.Module, q, k, kpm, causal, rows, values):  # type: ignore[no-untyped-def]
    """The student's output ``[1, H, R, dv]`` at the query rows ``rows``. Every query
    enters the estimator (position-aware estimators such as a sliding window need
    query ``i`` at position ``i``); only the loss is restricted to ``rows``."""
    return est(q, k, values, causal=causal, key_padding_mask=kpm)[:, :, rows]


def _loss(est, layer: _Layer, i: int, rows: Any, loss: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    q, k, v, kpm = layer.q[i], layer.k[i], layer.v[i], layer.kpm[i]
    p = _teacher_rows(q, k, kpm, layer.causal, rows, layer.scale)  # [1, H, R, M]
    if loss == "ce":
        # the student's rows: one-hot values by default, formed directly where the
        # estimator can (sliding-window: O(R M (d + D)) instead of a d_v = M call)
        p_hat = est.attention_rows(q, k, torch.as_tensor(rows), causal=layer.causal, key_padding_mask=kpm)
        log_p = torch.where(p > 0, p, torch.ones_like(p)).log()
        kl = (p * (log_p - p_hat.clamp_min(_EPS).log())).sum(-1)  # [1, H, R]
        return kl.mean()
    target = p @ v  # [1, H, R, dv]
    out = _student_rows(est, q, k, kpm, layer.causal, rows, v)
    return ((out - target) ** 2).sum() / (target**2).sum().clamp_min(_EPS)


def _valid_rows(layer: _Layer, i: int) -> torch.Tensor:
    kpm = layer.kpm[i]
    n = layer.q[i].shape[2]
    if kpm is None or kpm.shape[1] != n:
        return torch.arange(n)
    return torch.nonzero(~kpm[0].cpu()).flatten()


@torch.no_grad()
def _evaluate(est: nn.Module, layer: _Layer, loss: str) -> tuple[float, float]:
    """(loss over every valid query row, output relative error) on the layer's data."""
    total, count, num, den = 0.0, 0, 0.0, 0.0
    for i in range(len(layer.q)):
        rows = _valid_rows(layer, i)
        total += float(_loss(est, layer, i, rows, loss)) * len(rows)
        count += len(rows)
        q, k, v, kpm = layer.q[i], layer.k[i], layer.v[i], layer.kpm[i]
        ref = _teacher_rows(q, k, kpm, layer.causal, rows, layer.scale) @ v
        out = _student_rows(est, q, k, kpm, layer.causal, rows, v)
        num += float(((out - ref) ** 2).sum())
        den += float((ref**2).sum())
    return total / max(count, 1), math.sqrt(num / max(den, _EPS))


def _calibrate(est: nn.Module, layer: _Layer) -> None:
    """Data-adapted maps (CEXP's :math:`A`) take their statistics from the fitting data."""
    fm = getattr(est, "feature_map", None)
    if fm is None or not callable(getattr(fm, "fit", None)) or not hasattr(est, "transform"):
        return
    xs, ys = [], []
    for i in range(len(layer.q)):
        x, y = est.transform(layer.q[i], layer.k[i])  # [1, H, N, d]
        rows = _valid_rows(layer, i)
        xs.append(x[:, :, rows].reshape(-1, x.shape[-1]))
        ys.append(y[:, :, rows].reshape(-1, y.shape[-1]))
    with torch.no_grad():
        fm.fit(torch.cat(xs), torch.cat(ys))


class _Bar:
    """A progress bar: ``rich`` when installed, else the core's plain one; silent
    unless enabled (by default when stderr is a terminal)."""

    def __init__(self, total: int, label: str, enabled: bool | None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._rich = None
        self._plain = None
        if not self.enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import Progress

            self._rich = Progress(console=Console(stderr=True), transient=False)
            self._rich.start()
            self._task = self._rich.add_task(label, total=total)
        except ImportError:  # pragma: no cover - rich is optional
            from ..report.progress import Progress as Plain

            self._plain = Plain(total, label).__enter__()

    def advance(self, note: str = "") -> None:
        if self._rich is not None:
            self._rich.update(self._task, advance=1, description=note or None)
        elif self._plain is not None:
            self._plain.advance(note)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self._plain is not None:
            self._plain.__exit__(None, None, None)


def anchor_penalty(params: Sequence[torch.Tensor], start: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2-SP term :math:`\\sum_i \\lVert \\theta_i - \\theta_i^{(0)} \\rVert^2` of parameters
    ``params`` against their starting values ``start`` (Li et al., 2018): the fitting
    stages add ``anchor`` times it to their loss so that a small corpus does not pull the
    parameters far from where they started."""
    return sum(((p - p0) ** 2).sum() for p, p0 in zip(params, start, strict=True))  # type: ignore[return-value]


def _fit_layer(
    est: nn.Module,
    layer: _Layer,
    *,
    steps: int,
    lr: float,
    loss: str,
    rows: int,
    gen: torch.Generator,
    bar: _Bar | None = None,
    label: str = "",
    anchor: float = 0.0,
) -> None:
    """Adam on the estimator's trainable parameters, one sequence per step, ``rows``
    random valid query rows in the loss (the estimator must be in eval mode); with
    ``anchor > 0`` the loss gains ``anchor`` times :func:`anchor_penalty` against the
    parameters' values at the start (measured for the MiniLM recipe by
    ``scripts/fit_generalisation.py``: no gain there, so the conversion leaves it off)."""
    params = [p for p in est.parameters() if p.requires_grad]
    if not params or not steps:
        for _ in range(steps if bar is not None else 0):
            bar.advance(f"{label} (nothing to fit)")  # type: ignore[union-attr]
        return
    start = [p.detach().clone() for p in params] if anchor else []
    opt = torch.optim.Adam(params, lr=lr)
    for step in range(steps):
        i = step % len(layer.q)
        valid = _valid_rows(layer, i)
        pick = valid[torch.randperm(len(valid), generator=gen)[:rows]].sort().values
        value = _loss(est, layer, i, pick, loss)
        if anchor:
            value = value + anchor * anchor_penalty(params, start)
        opt.zero_grad()
        value.backward()
        opt.step()
        if bar is not None:
            bar.advance(f"{label} {loss} {value.item():.4f}")


def distill_attention(
    student: nn.Module,
    teacher: nn.Module,
    batches: Iterable[Any] | dict[str, torch.Tensor] | torch.Tensor,
    *,
    steps: int = 200,
    lr: float = 1e-2,
    loss: str = "ce",
    rows: int = 128,
    seed: int = 0,
    progress: bool | None = None,
    eval_texts: dict[str, str] | Sequence[str] | None = None,
    tokenizer: Any = None,
) -> DistillReport:
    """Fit every converted layer of ``student`` to the softmax attention of ``teacher``.

    Parameters
    ----------
    student : nn.Module
        The output of :func:`~kernelattn_core.convert.convert_attention` (changed in place).
    teacher : nn.Module
        The model that was converted (softmax attention); only run, never changed.
    batches : iterable
        Inputs of the teacher: dicts of keyword arguments (``input_ids``,
        ``attention_mask`` for Hugging Face models), tuples of positional arguments, or
        tensors. Every sequence of every batch is one fitting example.
    steps : int
        Adam steps per layer; each step takes one sequence (in turn); every query
        enters the estimator and ``rows`` random valid query rows enter the loss.
    lr : float
        Adam learning rate.
    loss : {"ce", "mse"}
        Cross-entropy between attention rows (reported as KL), or relative output
        MSE. For signed estimators (rows that can be negative) ``"mse"`` is the
        meaningful one.
    rows : int
        Query rows in the loss of each step (the teacher's rows are formed only for
        them).
    seed : int
        Seed of the row sampling.
    progress : bool, optional
        Progress bar on stderr (default: when stderr is a terminal).
    eval_texts : dict or sequence of str, optional
        Held-out texts (``name -> text``, or names of
        :func:`~kernelattn_core.workloads.minilm.read_texts`) on which the fitted model's
        embeddings are compared with the teacher's after the fit
        (:func:`~kernelattn_core.convert.report.embedding_report`; Hugging Face encoders).
        Never the fitting text.
    tokenizer : optional
        The models' tokenizer (needed with ``eval_texts``).

    Returns
    -------
    DistillReport
        Per layer: loss and output relative error before and after, seconds; per
        evaluation text, the embedding report.

    Notes
    -----
    Estimators without trainable parameters are only evaluated (and calibrated, for
    data-adapted maps such as CEXP, whose :math:`A` is set from the fitting data by
    the map's ``fit``). The estimator runs in eval mode during fitting (frozen draws)
    and is left in the mode it had.
    """
    check_positive_int("steps", steps, minimum=0)
    check_positive_int("rows", rows)
    check_choice("loss", loss, ("ce", "mse"))
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
        raise InputError(f"lr: expected a positive number, got {lr!r}")
    if eval_texts is not None and tokenizer is None:
        raise InputError("tokenizer: needed to embed eval_texts (pass the models' tokenizer)")
    start = time.perf_counter()
    from .attention import converted_modules

    layers = capture_layers(student, teacher, batches)
    modules = dict(converted_modules(student))
    report = DistillReport(loss=loss, steps=steps)
    gen = torch.Generator().manual_seed(seed)
    bar = _Bar(steps * len(layers), "fitting", progress)
    try:
        for index, (name, layer) in enumerate(layers.items()):
            t0 = time.perf_counter()
            est = modules[name].estimator
            was_training = est.training
            est.eval()
            _calibrate(est, layer)
            before = _evaluate(est, layer, loss)
            params = [p for p in est.parameters() if p.requires_grad]
            start_state = {k: v.detach().clone() for k, v in est.state_dict().items()}
            _fit_layer(est, layer, steps=steps, lr=lr, loss=loss, rows=rows, gen=gen, bar=bar, label=f"layer {index}")
            after = _evaluate(est, layer, loss)
            restored = not after[0] <= before[0]  # NaN included
            if restored:
                est.load_state_dict(start_state)
                after = before
            est.train(was_training)
            report.layers.append(
                LayerReport(
                    layer=index,
                    name=name,
                    parameters=sum(p.numel() for p in params),
                    loss_before=before[0],
                    loss_after=after[0],
                    error_before=before[1],
                    error_after=after[1],
                    seconds=time.perf_counter() - t0,
                    restored=restored,
                )
            )
    finally:
        bar.close()
    report.seconds = time.perf_counter() - start
    if eval_texts is not None:
        from .report import embedding_reports

        report.embeddings = embedding_reports(teacher, student, tokenizer, eval_texts)
    return report


@torch.no_grad()
def output_errors(student: nn.Module, teacher: nn.Module, batches: Iterable[Any]) -> list[dict[str, Any]]:
    """Per converted layer, the output relative error :math:`\\|\\hat o - o\\|_F / \\|o\\|_F`
    of the student's estimator against the teacher's softmax attention, on the
    teacher's ``q, k, v`` for ``batches`` (valid query rows only; random draws frozen).

    Returns
    -------
    list of dict
        ``{"layer", "name", "output_rel_error"}`` in layer order.
    """
    from .attention import converted_modules

    layers = capture_layers(student, teacher, batches)
    modules = dict(converted_modules(student))
    out = []
    for index, (name, layer) in enumerate(layers.items()):
        est = modules[name].estimator
        was_training = est.training
        est.eval()
        num = den = 0.0
        for i in range(len(layer.q)):
            rows = _valid_rows(layer, i)
            q, k, v, kpm = layer.q[i], layer.k[i], layer.v[i], layer.kpm[i]
            ref = _teacher_rows(q, k, kpm, layer.causal, rows, layer.scale) @ v
            got = _student_rows(est, q, k, kpm, layer.causal, rows, v)
            num += float(((got - ref) ** 2).sum())
            den += float((ref**2).sum())
        est.train(was_training)
        out.append({"layer": index, "name": name, "output_rel_error": math.sqrt(num / max(den, _EPS))})
    return out
