"""Task-level benchmarks: what a model learns with each attention estimator.

``kernelattn tasks`` (and :func:`run_tasks`) trains the same small Transformer
(:class:`TaskModel`) with each chosen estimator on generated tasks and reports held-out
accuracy, steps to 90 % of the exact model's accuracy, time per step and peak memory, beside
two references: ``exact`` (softmax attention, the ceiling) and ``baseline:no-mixing`` (the
same model without attention, the floor).

Tasks (each module's docstring states its generator's rules and source):

* ``mqar`` (:mod:`.mqar`): multi-query associative recall (Zoology);
* ``listops`` (:mod:`.listops`): nested list operations (LRA);
* ``selective-copy`` (:mod:`.selective_copy`): copy the marked tokens (Mamba);
* ``induction`` (:mod:`.induction`): complete a repeated pattern (induction heads).
"""

from __future__ import annotations

from .base import IGNORE, SCALES, Task, TaskBatch, TaskConfig
from .induction import TASK as INDUCTION
from .listops import TASK as LISTOPS
from .model import NO_MIXING, TaskModel
from .mqar import TASK as MQAR
from .selective_copy import TASK as SELECTIVE_COPY

#: every task, by name
TASKS: dict[str, Task] = {t.name: t for t in (MQAR, LISTOPS, SELECTIVE_COPY, INDUCTION)}


def get_task(name: str) -> Task:
    """The task called ``name``, or an :class:`~kernelattn_core.errors.InputError` listing them."""
    from ..errors import InputError

    if name not in TASKS:
        raise InputError(f"task: expected one of {', '.join(TASKS)}, got {name!r}")
    return TASKS[name]


__all__ = ["IGNORE", "NO_MIXING", "SCALES", "TASKS", "Task", "TaskBatch", "TaskConfig", "TaskModel", "get_task"]
