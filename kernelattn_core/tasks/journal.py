"""A journal of finished training runs, so that an interrupted :func:`~kernelattn_core.tasks.run.run_tasks` resumes.

A sweep such as ``kernelattn tasks --preset seeds`` trains some sixty runs over half an
hour on a CPU (``--scale paper``: hours on a GPU); stopped by a keyboard interrupt, a
closed laptop or a failed machine, it would have to start again. With a journal every
run that finishes is appended to a file at once, one JSON object per line, and a later
call with the same journal takes the runs it finds there instead of training them again.

A recorded run is reused only for the same run under the same code: the key is the task,
the estimator as asked for (with its options), the budget, the seed, the scale, the whole
training recipe (:class:`~kernelattn_core.tasks.train.TrainConfig`), the estimator options
the budget gave, the device, the compile backend and the threads per run (another thread
count rounds the reductions differently), and every line carries a *code fingerprint*:
a hash of the sources of ``kernelattn_core`` and of every package that registered an
estimator, feature map, kernel or normaliser, with torch's version. Change any of them and
the recorded runs are kept in the file but not reused. A run that failed is not recorded
(it is tried again); a line cut short by a kill in the middle of a write is skipped.

Usage::

    kernelattn tasks --preset seeds --journal seeds.jsonl --output seeds.json
    # interrupted? the same command again trains only the runs the journal lacks
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["RunJournal", "code_fingerprint", "run_key"]


def run_key(
    task: str,
    estimator: str,
    budget: int | None,
    seed: int,
    *,
    scale: str,
    config: dict[str, Any],
    options: dict[str, Any],
    device: str,
    compiled: str | bool,
    threads: int,
) -> dict[str, Any]:
    """The identity of one run: what :class:`RunJournal` matches a recorded run by."""
    return {
        "task": task,
        "estimator": estimator,
        "budget": budget,
        "seed": seed,
        "scale": scale,
        "config": config,
        "options": options,
        "device": device,
        "compiled": compiled,
        "threads": threads,
    }


def _canonical(run: dict[str, Any]) -> str:
    """``run`` as a canonical JSON string (keys sorted; tuples and lists alike)."""
    return json.dumps(run, sort_keys=True, default=str)


def _package_files(module_name: str) -> list[Path]:
    """The ``.py`` files of the top-level package (or the single module) ``module_name`` belongs to."""
    top = sys.modules.get(module_name.split(".")[0])
    if top is None:
        return []
    paths = getattr(top, "__path__", None)
    if paths:  # a package: every source file under its directories
        return sorted(p for d in paths for p in Path(d).rglob("*.py"))
    file = getattr(top, "__file__", None)
    return [Path(file)] if file else []


@functools.cache
def code_fingerprint() -> str:
    """A short hash of the code a training run depends on: the sources of ``kernelattn_core``
    and of the packages of every registered class, and torch's version (computed once per
    process; the plugins loaded then are the ones that count)."""
    import torch

    from ..registry import get_registry

    modules = {"kernelattn_core"} | {entry.cls.__module__ for entry in get_registry().entries()}
    files = sorted({f.resolve() for m in modules for f in _package_files(m)})
    digest = hashlib.sha256(f"torch {torch.__version__}\n".encode())
    for f in files:
        digest.update(f.name.encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


class RunJournal:
    """Finished runs, read from and appended to a JSON-lines file.

    Parameters
    ----------
    path : str or PathLike
        The journal file, created (with its folder) if missing. An existing file is read:
        its runs recorded under this code (:func:`code_fingerprint`) become available to
        :meth:`get`. A path that cannot be written raises an
        :class:`~kernelattn_core.errors.InputError` here.

    Attributes
    ----------
    on_record : int
        Runs read from the file that this code may reuse.
    other_code : int
        Runs read from the file that were recorded under other code (kept, not reused).
    reused, recorded : int
        Runs taken from the journal, and runs appended to it, by this process.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from ..errors import InputError

        self.path = Path(path)
        if self.path.exists() and not self.path.is_file():
            raise InputError(f"journal: expected a file path, got the folder {str(self.path)!r}")
        self.fingerprint = code_fingerprint()
        self._runs: dict[str, dict[str, Any]] = {}
        self.other_code = 0
        self.reused = self.recorded = 0
        text = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
        for line in text.splitlines():
            try:
                entry = json.loads(line)
                key, code, result = _canonical(entry["run"]), entry["code"], entry["result"]
            except (ValueError, KeyError, TypeError):  # a line cut short by a kill, or not ours
                continue
            if code == self.fingerprint:
                self._runs[key] = result
            else:
                self.other_code += 1
        self.on_record = len(self._runs)
        try:  # a file that cannot be written fails now, not after the first run trained
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                if text and not text.endswith("\n"):  # a line cut short: the next run starts its own
                    f.write("\n")
        except OSError as exc:
            raise InputError(f"journal: cannot write {str(self.path)!r} ({exc.strerror or exc})") from exc

    def get(self, run: dict[str, Any]) -> dict[str, Any] | None:
        """The recorded result of ``run`` (:func:`run_key`), or ``None``."""
        result = self._runs.get(_canonical(run))
        if result is not None:
            self.reused += 1
        return result

    def add(self, run: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        """Append the finished ``run`` (:func:`run_key`) with its ``result`` (as
        :func:`~kernelattn_core.tasks.train.train` returned it), flushed to disk before
        returning; returns the result as the journal holds it (read back from JSON: tuples
        become lists), as :meth:`get` would give it later."""
        line = json.dumps({"run": run, "code": self.fingerprint, "result": result}, default=str)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        stored = json.loads(line)["result"]  # as a later process will read it
        self._runs[_canonical(run)] = stored
        self.recorded += 1
        return stored

    def _other(self) -> str:
        return f"; {self.other_code} recorded under other code, not reused" if self.other_code else ""

    def opening(self) -> str | None:
        """One line on what the file held when it was read, or ``None`` for a new or empty journal."""
        if not (self.on_record or self.other_code):
            return None
        return f"journal {self.path}: {self.on_record} finished run(s) on record{self._other()}"

    def summary(self) -> str:
        """One line on what the journal held and what this process did with it."""
        return (
            f"journal {self.path}: {self.reused} run(s) reused, {self.recorded} trained and recorded "
            f"({self.on_record} on record at the start{self._other()})"
        )
