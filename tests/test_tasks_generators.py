"""The task generators: deterministic from the seed, answers checked by independent
evaluators that read only what a model may see, and no answer visible where it is asked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernelattn_core.errors import InputError
from kernelattn_core.tasks import IGNORE, TASKS, get_task
from kernelattn_core.tasks import listops as lo


@pytest.mark.parametrize("name", list(TASKS))
def test_same_seed_same_batch_other_seed_other_batch(name: str) -> None:
    task = get_task(name)
    a, b, c = (task.batch(16, seed=s) for s in (3, 3, 4))
    assert torch.equal(a.inputs, b.inputs)
    assert not torch.equal(a.inputs, c.inputs) or a.inputs.shape != c.inputs.shape
    for x in (a.targets, a.labels):
        if x is not None:
            assert torch.equal(x, b.targets if x is a.targets else b.labels)
    cfg = task.config("quick")
    assert int(a.inputs.min()) >= 0 and int(a.inputs.max()) < cfg.vocab_size
    assert a.inputs.shape[1] <= cfg.seq_len


@pytest.mark.parametrize("name", list(TASKS))
def test_paper_scale_batches_have_the_declared_sizes(name: str) -> None:
    task = get_task(name)
    cfg = task.config("paper")
    batch = task.batch(2, scale="paper", seed=0)
    assert batch.inputs.shape[1] <= cfg.seq_len and int(batch.inputs.max()) < cfg.vocab_size


def test_bad_arguments_are_named() -> None:
    with pytest.raises(InputError, match="task: expected one of mqar"):
        get_task("nope")
    with pytest.raises(InputError, match="scale: expected one of quick, paper, got 'huge'"):
        get_task("mqar").batch(2, scale="huge")
    with pytest.raises(InputError, match="batch_size: expected a positive int, got 0"):
        get_task("mqar").batch(0)


# ----------------------------------------------------------------- independent evaluators
def _mqar_answer(prefix: list[int], half: int) -> int | None:
    """The value bound to the last token (a key) in the key-value pairs of ``prefix``: the
    first occurrence of the key at an even position followed by a value token."""
    key = prefix[-1]
    for i in range(0, len(prefix) - 2, 2):
        if prefix[i] == key and prefix[i + 1] >= half:
            return prefix[i + 1]
    return None


def test_mqar_answers_follow_from_the_visible_pairs() -> None:
    task = get_task("mqar")
    cfg = task.config("quick")
    batch = task.batch(64, seed=11)
    pairs, half = cfg.params["pairs"], cfg.vocab_size // 2
    for row, target in zip(batch.inputs.tolist(), batch.targets.tolist()):
        scored = [t for t, y in enumerate(target) if y != IGNORE]
        assert len(scored) == pairs
        keys = row[0 : 2 * pairs : 2]
        assert len(set(keys)) == pairs and all(1 <= k < half for k in keys)
        assert all(half <= v < cfg.vocab_size for v in row[1 : 2 * pairs : 2])
        asked = [row[t] for t in scored]
        assert sorted(asked) == sorted(keys)  # every key asked once
        for t in scored:
            assert t >= 2 * pairs
            assert _mqar_answer(row[: t + 1], half) == target[t]  # determined by what a causal model sees
            assert row[t] != target[t]  # the position asks with the key, not the answer


def _stack_eval(text: str) -> int:
    """Evaluate a ListOps expression with an explicit stack (no recursion, no tree)."""
    stack: list[list] = []
    result = None
    for tok in text.split():
        if tok.startswith("["):
            stack.append([tok])
        elif tok == "]":
            op, *args = stack.pop()
            if op == "[MIN":
                val = min(args)
            elif op == "[MAX":
                val = max(args)
            elif op == "[SM":
                val = sum(args) % 10
            else:  # median, LRA's int(np.median(x)) on non-negative digits
                s = sorted(args)
                n = len(s)
                val = s[n // 2] if n % 2 else int((s[n // 2 - 1] + s[n // 2]) / 2)
            if stack:
                stack[-1].append(val)
            else:
                result = val
        else:
            stack[-1].append(int(tok))
    assert not stack and result is not None
    return result


def test_listops_labels_match_an_independent_stack_evaluator() -> None:
    task = get_task("listops")
    cfg = task.config("quick")
    for seed in range(4):
        batch = task.batch(64, seed=seed)
        lengths = (~batch.padding).sum(1)
        for row, label, n in zip(batch.inputs, batch.labels, lengths):
            text = lo.decode(row)
            assert _stack_eval(text) == int(label)
            assert cfg.params["min_length"] <= int(n) <= cfg.params["max_length"]
            assert bool((row[: int(n)] != lo.PAD).all()) and bool((row[int(n) :] == lo.PAD).all())
    assert batch.inputs.shape[1] % 16 == 0 or batch.inputs.shape[1] == cfg.seq_len


def test_listops_median_of_an_even_count_truncates_like_lra() -> None:
    assert lo.apply("[MED", [1, 2]) == 1 and lo.apply("[MED", [3, 9, 4, 8]) == 6
    assert lo.apply("[SM", [9, 9, 3]) == 1 and lo.apply("[MAX", [0, 7]) == 7 and lo.apply("[MIN", [5, 2]) == 2


def test_listops_classes_are_spread_and_depth_is_bounded() -> None:
    task = get_task("listops")
    labels = torch.cat([task.batch(128, seed=s).labels for s in range(4)])
    counts = torch.bincount(labels, minlength=10).float() / labels.numel()
    assert counts.min() > 0.03 and counts.max() < 0.3  # no class a majority guess could ride on
    batch = task.batch(64, seed=9)
    depth_max = task.config("quick").params["max_depth"]
    for row in batch.inputs:
        depth = running = 0
        for tok in lo.decode(row).split():
            running += tok.startswith("[")
            running -= tok == "]"
            depth = max(depth, running)
        assert 1 <= depth <= depth_max


def test_listops_length_bounds_are_respected_at_other_settings() -> None:
    cfg = dataclasses.replace(
        lo.CONFIGS["quick"], params={"max_depth": 3, "max_args": 3, "min_length": 8, "max_length": 20}
    )
    batch = lo.make(32, cfg, torch.Generator().manual_seed(0))
    lengths = (~batch.padding).sum(1)
    assert int(lengths.min()) >= 8 and int(lengths.max()) <= 20


def test_selective_copy_targets_are_the_context_tokens_in_order() -> None:
    task = get_task("selective-copy")
    cfg = task.config("quick")
    copies = cfg.params["copies"]
    batch = task.batch(64, seed=5)
    for row, target in zip(batch.inputs.tolist(), batch.targets.tolist()):
        context = row[: len(row) - copies]
        data = [t for t in context if t >= 2]  # what a model can read: everything but noise
        assert len(data) == copies
        assert row[len(row) - copies :] == [1] * copies  # markers carry no data
        assert [y for y in target if y != IGNORE] == data
        assert target[: len(row) - copies] == [IGNORE] * (len(row) - copies)
    positions = (batch.inputs[:, : cfg.seq_len - copies] >= 2).float().mean(0)
    assert float(positions.std()) < 0.1  # data positions vary (no fixed shift solves it)


def test_induction_targets_follow_the_earlier_occurrence() -> None:
    task = get_task("induction")
    cfg = task.config("quick")
    s = cfg.params["repeat"]
    batch = task.batch(64, seed=8)
    starts = []
    for row, target in zip(batch.inputs.tolist(), batch.targets.tolist()):
        prefix = row[: len(row) - s]
        assert len(set(prefix)) == len(prefix) and 0 not in prefix
        scored = [t for t, y in enumerate(target) if y != IGNORE]
        assert scored == list(range(len(row) - s, len(row)))
        for t in scored:
            earlier = [j for j in range(t) if row[j] == row[t]]
            assert len(earlier) == 1  # one earlier occurrence, read from the visible prefix
            assert target[t] == row[earlier[0] + 1]
            assert row[t] != target[t]
        starts.append(row.index(row[len(row) - s]))
    assert len(set(starts)) > 10  # the window's offset varies


@pytest.mark.parametrize("name", [n for n, t in TASKS.items() if t.kind == "lm"])
def test_lm_answer_is_never_the_asking_token_and_guessing_is_near_chance(name: str) -> None:
    # (that the answers follow from the visible prefix is checked per task above; that the
    # model cannot see later positions is checked in test_tasks_model.py)
    task = get_task(name)
    batch = task.batch(32, seed=2)
    scored = batch.targets != IGNORE
    assert bool((batch.inputs[scored] != batch.targets[scored]).all())
    answers = batch.targets[scored]
    top = torch.bincount(answers).max().item() / answers.numel()
    assert top < 0.15  # no single answer a model could guess its way to
