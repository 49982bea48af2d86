"""The task model: every estimator builds and trains, nothing leaks from later positions or
from padding, the floor cannot mix tokens, and the ceiling learns a small task."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kernelattn_core.tasks import NO_MIXING, TaskModel, get_task
from kernelattn_core.tasks.run import budget_options, cannot_run, default_estimators
from kernelattn_core.tasks.train import TrainConfig, accuracy, eval_batches, lr_factor, train

TINY = TrainConfig(
    steps=20, batch_size=16, lr=3e-3, d_model=32, num_heads=2, num_layers=2, eval_size=32, eval_every=10, curve_size=16
)


def tiny(name: str, **params: int):  # type: ignore[no-untyped-def]
    """The task with a small quick config (so every estimator trains in about a second)."""
    task = get_task(name)
    cfg = task.config("quick")
    sizes = {
        "mqar": (32, 32, {"pairs": 4}),
        "listops": (64, cfg.vocab_size, {"max_depth": 3, "max_args": 4, "min_length": 8, "max_length": 64}),
    }[name]
    small = dataclasses.replace(cfg, seq_len=sizes[0], vocab_size=sizes[1], params={**sizes[2], **params})
    return dataclasses.replace(task, configs={"quick": small})


def _all_names() -> list[str]:
    return default_estimators(quadratic=True)


@pytest.mark.parametrize("name", _all_names())
def test_every_estimator_trains_twenty_steps_with_falling_loss(name: str) -> None:
    task = tiny("mqar")
    if cannot_run(name, task) is not None:
        task = tiny("listops")
    assert cannot_run(name, task) is None, f"{name} runs on neither kind of task"
    options = budget_options(name, 16, task.causal)
    result = train(task, "softmax" if name == "exact" else name, TINY, seed=0, options=options)
    assert result["last_loss"] < result["first_loss"], (name, result["first_loss"], result["last_loss"])
    assert 0.0 <= result["accuracy"] <= 1.0 and result["time_per_step_ms"] > 0 and result["peak_mem_mb"] > 0
    assert len(result["curve"]) == 2


def test_learned_maps_train_with_the_model() -> None:
    task = tiny("mqar")
    torch.manual_seed(0)
    model = TaskModel(32, 32, "lm", "hedgehog", d_model=32, num_features=16)
    batch = task.batch(8, seed=0)
    scored = batch.targets != -100
    loss = torch.nn.functional.cross_entropy(model(batch.inputs, None, scored), batch.targets[scored])
    loss.backward()
    fmap = model.blocks[0].attn.estimator.feature_map
    grads = [p.grad for p in fmap.parameters()]
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("name", ["softmax", "prf", "hedgehog", "sliding-window", "rfa-gate", NO_MIXING])
def test_causal_model_does_not_see_later_positions(name: str) -> None:
    torch.manual_seed(0)
    options = budget_options(name, 16, True) if name not in ("softmax", NO_MIXING) else {}
    model = TaskModel(40, 24, "lm", name, d_model=32, **options).eval()
    x = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[:, 13:] = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[:, :13], b[:, :13], atol=1e-5)
    assert not torch.allclose(a[:, 13:], b[:, 13:], atol=1e-3)  # later positions do change (control)


@pytest.mark.parametrize("name", ["softmax", "prf", "elu", "lara"])
def test_classifier_ignores_whatever_the_padding_holds(name: str) -> None:
    torch.manual_seed(0)
    options = budget_options(name, 16, False) if name not in ("softmax", "elu") else {}
    model = TaskModel(16, 32, "classify", name, num_classes=10, d_model=32, **options).eval()
    x = torch.randint(1, 16, (3, 32), generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(3, 32, dtype=torch.bool)
    pad[0, 20:], pad[1, 5:] = True, True
    y = x.masked_fill(pad, 0)
    z = torch.where(pad, torch.randint(1, 16, x.shape, generator=torch.Generator().manual_seed(3)), x)
    with torch.no_grad():
        a, b = model(y, pad), model(z, pad)
        c = model(z, None)  # control: unmasked, the padding's tokens count
    assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(a[:2], c[:2], atol=1e-3)


def test_floor_mixes_no_tokens_at_all() -> None:
    torch.manual_seed(0)
    model = TaskModel(40, 24, "lm", NO_MIXING, d_model=32).eval()
    x = torch.randint(0, 40, (1, 24), generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[0, 10] = (x[0, 10] + 1) % 40
    with torch.no_grad():
        diff = (model(x) - model(y)).abs().amax(-1)[0]
    assert (diff > 1e-6).nonzero().flatten().tolist() == [10]  # only the changed position
    assert all(b.attn is None and b.shift is None for b in model.blocks)
    control = TaskModel(40, 24, "lm", "softmax", d_model=32)
    for block in control.blocks:  # the shift starts at zero: give it weights to show its reach
        torch.nn.init.normal_(block.shift.proj.weight, std=0.3)
    control.eval()
    with torch.no_grad():
        reach = (control(x) - control(y)).abs().amax(-1)[0]
    assert (reach > 1e-6).nonzero().flatten().tolist() == list(range(10, 24))  # attention: every later position


def test_lr_schedule_warms_up_then_decays_to_zero() -> None:
    values = [lr_factor(s, 100) for s in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(b <= a for a, b in itertools.pairwise(values[10:])) and values[-1] < 0.01


def test_ceiling_learns_and_floor_stays_at_chance_on_a_small_recall_task() -> None:
    task = tiny("mqar")
    recipe = dataclasses.replace(TINY, steps=300, batch_size=32, eval_every=50, eval_size=256)
    exact = train(task, "softmax", recipe, seed=0)
    floor = train(task, NO_MIXING, recipe, seed=0)
    chance = task.chance(task.config("quick"))
    assert exact["accuracy"] > 0.9, exact["curve"]
    assert floor["accuracy"] < 3 * chance, floor["accuracy"]


def test_evaluation_set_is_not_the_training_stream() -> None:
    task = get_task("mqar")
    held = eval_batches(task, "quick", 0, 64, 64)[0]
    train_first = task.batch(64, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(held.inputs, train_first.inputs)
    again = eval_batches(task, "quick", 0, 64, 64)[0]
    assert torch.equal(held.inputs, again.inputs)
    model = TaskModel(256, 128, "lm", NO_MIXING, d_model=16)
    assert 0.0 <= accuracy(model, [held]) <= 0.05


def test_scored_positions_as_indices_give_the_rows_of_the_boolean_selection() -> None:
    """What a compiled model is given (``[S]`` indices into the flattened positions) selects
    the same rows in the same order as the boolean ``[B, N]`` mask the eager model takes."""
    from kernelattn_core.tasks import get_task
    from kernelattn_core.tasks.run import RECIPES
    from kernelattn_core.tasks.train import build_model

    task = get_task("mqar")
    model = build_model(task, "elu", RECIPES[("mqar", "quick")].updated(d_model=32), "quick", 0, {}).eval()
    batch = task.batch(4, scale="quick", generator=torch.Generator().manual_seed(0))
    scored = batch.targets != -100
    with torch.no_grad():
        by_mask = model(batch.inputs, batch.padding, scored)
        by_index = model(batch.inputs, batch.padding, scored.flatten().nonzero().squeeze(1))
        everywhere = model(batch.inputs, batch.padding)
    assert by_mask.shape[0] == int(scored.sum()) > 0
    assert torch.equal(by_index, by_mask)
    torch.testing.assert_close(everywhere[scored], by_mask)


def test_the_last_block_runs_its_mlp_at_the_scored_positions_only() -> None:
    """The last block's MLP, the final norm and the head see the ``S`` scored rows (where a
    prediction is read), the earlier blocks every position; the loss and every parameter's
    gradient equal those of the logits computed everywhere and then selected."""
    from kernelattn_core.tasks.run import RECIPES
    from kernelattn_core.tasks.train import build_model

    task = get_task("induction")
    model = build_model(task, "prf", RECIPES[("induction", "quick")].updated(d_model=32), "quick", 0, {})
    batch = task.batch(4, scale="quick", generator=torch.Generator().manual_seed(0))
    scored = batch.targets != -100
    seen = []
    hooks = [b.mlp.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape))) for b in model.blocks]
    model.eval()  # no redraw between the two passes
    loss = torch.nn.functional.cross_entropy(model(batch.inputs, None, scored), batch.targets[scored])
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    assert seen == [(4, 128, 32), (int(scored.sum()), 32)] and int(scored.sum()) == 4 * 32
    for h in hooks:
        h.remove()
    full = model(batch.inputs, None)[scored]
    loss_full = torch.nn.functional.cross_entropy(full, batch.targets[scored])
    torch.testing.assert_close(loss, loss_full)
    for g, g_full in zip(grads, torch.autograd.grad(loss_full, list(model.parameters()), allow_unused=True)):
        torch.testing.assert_close(g, g_full, rtol=1e-4, atol=1e-6)
