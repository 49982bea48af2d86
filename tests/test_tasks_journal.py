"""The run journal of ``run_tasks`` / ``kernelattn tasks --journal``: an interrupted sweep
resumes, training only the runs the journal lacks, with the records of an uninterrupted
call; recorded runs are never reused for another recipe, thread count or code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kernelattn_core.tasks.journal as journal_mod
import kernelattn_core.tasks.run as run_mod
from kernelattn_core.cli.main import main
from kernelattn_core.errors import InputError
from kernelattn_core.tasks.journal import RunJournal, code_fingerprint
from kernelattn_core.tasks.run import run_tasks

SMALL = {"eval_size": 32, "curve_size": 16, "eval_every": 2, "d_model": 32}
SAME = ("accuracies", "curves", "first_loss", "last_loss", "params", "steps_to_90", "learned", "error")


@pytest.fixture
def one_thread():  # type: ignore[no-untyped-def]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def trained(monkeypatch):  # type: ignore[no-untyped-def]
    """The (estimator, seed) of every run that ``run_tasks`` trains (the real ``train``)."""
    calls: list[tuple[str, int]] = []
    real = run_mod.train

    def counting(task, estimator, config, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((estimator, kwargs["seed"]))
        return real(task, estimator, config, **kwargs)

    monkeypatch.setattr(run_mod, "train", counting)
    return calls


def _sweep(path: Path, **kwargs) -> list[dict]:  # type: ignore[no-untyped-def]
    args = {"steps": 2, "progress": False, "recipe": SMALL, "seeds": [0, 1], "journal": path, **kwargs}
    return run_tasks(["mqar"], ["elu", "prf"], [8], **args)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _same(a: list[dict], b: list[dict]) -> None:
    assert [(r["estimator"], r["budget"]) for r in a] == [(r["estimator"], r["budget"]) for r in b]
    for x, y in zip(a, b, strict=True):
        for key in SAME:
            assert x.get(key) == y.get(key), (x["estimator"], key)


def test_an_interrupted_sweep_trains_only_the_missing_runs_and_gives_the_same_records(
    tmp_path, one_thread, trained
) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "runs" / "sweep.jsonl"  # the folder is created
    full = _sweep(path)
    assert len(trained) == 8  # exact, the floor, elu, prf; two seeds each
    lines = _lines(path)
    assert len(lines) == 8 and {line["code"] for line in lines} == {code_fingerprint()}
    assert lines[0]["run"]["config"]["steps"] == 2 and lines[0]["run"]["threads"] == 1
    # interrupted: prf's second seed never finished, and a kill cut its line short
    kept = [line for line in lines if (line["run"]["estimator"], line["run"]["seed"]) != ("prf", 1)]
    text = "".join(json.dumps(line) + "\n" for line in kept)
    path.write_text(text + json.dumps(lines[-1])[:57])
    trained.clear()
    resumed = _sweep(path)
    assert trained == [("prf", 1)]
    _same(full, resumed)
    again = _sweep(path)  # everything on record now: nothing trains
    assert trained == [("prf", 1)]
    _same(full, again)
    # the rows read the same whether their runs were trained or read back (pairs as lists)
    assert full[2]["curves"] == [[list(p) for p in curve] for curve in full[2]["curves"]]


def test_recorded_runs_are_not_reused_for_another_recipe_thread_count_or_code(
    tmp_path, one_thread, trained, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "sweep.jsonl"
    _sweep(path, seeds=[0])
    assert len(trained) == 4
    trained.clear()
    _sweep(path, seeds=[0], steps=3)  # another recipe
    assert len(trained) == 4
    trained.clear()
    _sweep(path, seeds=[0], recipe={**SMALL, "lr": 1e-3})
    assert len(trained) == 4
    trained.clear()
    torch.set_num_threads(2)  # another thread count rounds differently
    _sweep(path, seeds=[0])
    assert len(trained) == 4
    torch.set_num_threads(1)
    trained.clear()
    monkeypatch.setattr(journal_mod, "code_fingerprint", lambda: "changed-code")
    other = RunJournal(path)
    assert other.on_record == 0 and other.other_code == len(_lines(path))
    assert other.opening() == f"journal {path}: 0 finished run(s) on record; 16 recorded under other code, not reused"
    assert RunJournal(tmp_path / "new.jsonl").opening() is None
    _sweep(path, seeds=[0], journal=other)
    assert len(trained) == 4 and other.reused == 0 and other.recorded == 4
    trained.clear()
    _sweep(path, seeds=[0], journal=RunJournal(path))  # the same "changed" code: reused
    assert trained == []


def test_a_failed_run_is_not_recorded(tmp_path, one_thread, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    real = run_mod.train

    def failing(task, estimator, config, **kwargs):  # type: ignore[no-untyped-def]
        if estimator == "prf":
            raise FloatingPointError("training loss is nan (non-finite)")
        return real(task, estimator, config, **kwargs)

    monkeypatch.setattr(run_mod, "train", failing)
    path = tmp_path / "sweep.jsonl"
    records = _sweep(path, seeds=[0])
    assert records[-1]["estimator"] == "prf" and records[-1]["error"].startswith("FloatingPointError")
    assert [line["run"]["estimator"] for line in _lines(path)] == ["exact", "baseline:no-mixing", "elu"]


def test_parallel_jobs_reuse_and_record_runs(tmp_path, trained) -> None:  # type: ignore[no-untyped-def]
    """``jobs=2``: recorded runs are not submitted to the pool; the ones that train in a
    worker are recorded by the parent as they finish."""
    path = tmp_path / "sweep.jsonl"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the workers below run with 2 // 2 = 1 thread: the same runs
        full = _sweep(path)
        lines = _lines(path)
        path.write_text("".join(json.dumps(line) + "\n" for line in lines if line["run"]["estimator"] != "elu"))
        torch.set_num_threads(2)
        journal = RunJournal(path)
        resumed = _sweep(path, jobs=2, journal=journal)
    finally:
        torch.set_num_threads(threads)
    assert journal.reused == 6 and journal.recorded == 2  # elu's two seeds trained in the workers
    assert sorted(line["run"]["estimator"] for line in _lines(path)[-2:]) == ["elu", "elu"]
    _same(full, resumed)


def test_the_fingerprint_covers_the_sources_of_the_core_and_of_the_plugins(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    core = journal_mod._package_files("kernelattn_core")
    assert Path(journal_mod.__file__).resolve() in {f.resolve() for f in core}
    prf = journal_mod._package_files("kernelattn_prf.feature_maps")
    assert any(f.name == "feature_maps.py" for f in prf)
    fresh = code_fingerprint.__wrapped__  # not the cached value
    before = fresh()
    extra = tmp_path / "module.py"
    extra.write_text("x = 1\n")
    real = journal_mod._package_files
    monkeypatch.setattr(journal_mod, "_package_files", lambda m: real(m) + ([extra] if m == "kernelattn_core" else []))
    with_extra = fresh()
    extra.write_text("x = 2\n")
    assert len({before, with_extra, fresh()}) == 3  # a file more, then its contents changed


def test_a_journal_path_that_cannot_be_written_is_refused_before_training(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InputError, match="journal: expected a file path, got the folder"):
        RunJournal(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(InputError, match="journal: cannot write"):
        RunJournal(blocker / "sweep.jsonl")  # its folder would be a file
    assert main(["tasks", "--steps", "1", "--no-progress", "--journal", str(tmp_path)]) == 2
    assert "journal: expected a file path" in capsys.readouterr().err


def test_cli_journal_resumes_and_says_so(tmp_path, capsys, one_thread) -> None:  # type: ignore[no-untyped-def]
    path, out = tmp_path / "sweep.jsonl", tmp_path / "out.json"
    argv = ["tasks", "--estimator", "elu", "--steps", "1", "--no-progress", "--journal", str(path)]
    argv += ["--output", str(out)]
    assert main(argv) == 0
    assert "journal " + str(path) + ": 0 run(s) reused, 3 trained and recorded" in capsys.readouterr().err
    first = json.loads(out.read_text())
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"journal {path}: 3 finished run(s) on record\n")  # said before the first row
    assert ": 3 run(s) reused, 0 trained and recorded (3 on record at the start)" in err
    assert json.loads(out.read_text()) == first  # every field, the times included: the same runs


def test_an_interrupt_stops_the_worker_pool_at_once() -> None:
    """``_stop`` (what an interrupt of ``jobs > 1`` runs): the running worker ends now, not
    when its run would have finished, and so does the pool's manager thread, which the
    interpreter joins at exit (an interrupted sweep waited a run's length there)."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    running = pool.submit(time.sleep, 60)
    for _ in range(3):
        pool.submit(time.sleep, 60)
    deadline = time.monotonic() + 60
    while not running.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    worker, manager = next(iter(pool._processes.values())), pool._executor_manager_thread
    start = time.monotonic()
    run_mod._stop(pool)
    worker.join(10)
    manager.join(10)
    assert not worker.is_alive() and not manager.is_alive() and time.monotonic() - start < 10
