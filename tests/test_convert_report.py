"""The embedding report by length, the end-to-end stage and the budget allocation
(issue 28), on tiny randomly initialised BERT models built here; the shipped MiniLM is
exercised by the slow test of tests/test_convert.py.

CI cost: about 15 s.
"""

from __future__ import annotations

import math

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.convert import convert_attention, converted_modules, distill_attention
from kernelattn_core.convert.report import (
    BUCKETS,
    embedding_report,
    nn_agreement,
    pieces,
    spearman_similarity,
)

transformers = pytest.importorskip("transformers")

WORDS = "the river runs past old mill slow in summer and loud spring children walk along its bank".split()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vocab")
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *WORDS]))
    return transformers.BertTokenizer(str(vocab))


def tiny(positions: int = 128) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=positions,
        initializer_range=0.4,  # attention that matters (at 0.02 it moves embeddings by 1e-9)
        attn_implementation="eager",
    )
    return transformers.BertModel(config).double().eval()


def _text(sentences: int = 40, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(sentences):
        n = int(torch.randint(4, 30, (1,), generator=g))
        out.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g)) + ".")
    return " ".join(out)


# ---------------------------------------------------------------------- the statistics
def test_nn_agreement_counts_rows_whose_nearest_neighbour_is_kept() -> None:
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert nn_agreement(x, x) == 1.0
    assert nn_agreement(x, 3.0 * x) == 1.0  # cosine: scale does not matter
    y = x.clone()
    y[0] = -x[0]  # one point moved to the far side changes some neighbourhoods
    assert nn_agreement(x, y) < 1.0
    # a random other set agrees only by chance (negative control)
    z = torch.randn(12, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert nn_agreement(x, z) < 0.5
    assert math.isnan(nn_agreement(x[:1], x[:1]))


def test_spearman_of_similarity_matrices_is_a_rank_correlation() -> None:
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert spearman_similarity(x, x) == pytest.approx(1.0)
    # a monotone change of the similarities keeps the ranks: Spearman 1, Pearson would not be
    n = 10
    iu = torch.triu_indices(n, n, 1)
    s = torch.nn.functional.normalize(x, dim=-1)
    sims = (s @ s.T)[iu[0], iu[1]]
    from kernelattn_core.convert.report import _ranks

    r = _ranks(sims)
    assert sorted(r.tolist()) == list(range(len(sims)))
    assert torch.equal(sims.argsort(), r.argsort())
    z = torch.randn(10, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert abs(spearman_similarity(x, z)) < 0.5  # unrelated embeddings (negative control)


def test_pieces_are_packed_without_padding(tokenizer) -> None:
    text = _text(30)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out = pieces(tokenizer, text, 16)
    assert out.shape == (len(ids) // 14, 16)
    assert (out[:, 0] == tokenizer.cls_token_id).all() and (out[:, -1] == tokenizer.sep_token_id).all()
    assert out[1, 1:-1].tolist() == ids[14:28]  # consecutive, non-overlapping
    assert pieces(tokenizer, "the river.", 16).shape == (0, 16)
    assert pieces(tokenizer, text, 16, limit=2).shape[0] == 2
    with pytest.raises(ka.InputError, match="length"):
        pieces(tokenizer, text, 2)


# ---------------------------------------------------------------------- the report
def test_report_of_the_exact_conversion_is_one_everywhere_and_an_approximation_is_not(tokenizer) -> None:
    teacher = tiny()
    text = _text(60)
    exact = embedding_report(teacher, convert_attention(teacher, "softmax"), tokenizer, text, max_length=128)
    assert [b["bucket"] for b in exact.buckets] == [b[0] for b in BUCKETS]
    counted = {b["bucket"]: b["count"] for b in exact.buckets}
    assert counted["<=25"] > 0 and counted["26-127"] > 0 and counted["128-511"] > 0 and counted["512"] == 0
    assert exact.passages["128"]["count"] > 0 and exact.passages["512"]["count"] == 0  # the model has 128 positions
    for b in exact.buckets:
        if b["count"]:
            assert b["mean"] == pytest.approx(1.0, abs=1e-12) and b["min"] == pytest.approx(1.0, abs=1e-12)
    assert exact.nn_agreement == 1.0 and exact.spearman == pytest.approx(1.0)
    assert exact.headline == pytest.approx(1.0, abs=1e-12)  # the longest passages there are: 128
    flat = exact.flat()
    assert flat["cos_le25_count"] == counted["<=25"] and flat["passage128_count"] > 0
    approx = embedding_report(teacher, convert_attention(teacher, "elu"), tokenizer, text, max_length=128)
    assert approx.headline < 1 - 1e-6
    assert approx.buckets[2]["min"] <= approx.buckets[2]["mean"] < 1 - 1e-6


def test_a_window_covering_short_texts_is_exact_there_and_not_on_passages(tokenizer) -> None:
    """The issue's point: a window + [CLS] computes short texts exactly, so only the
    long buckets show the approximation."""
    teacher = tiny()
    student = convert_attention(teacher, "sliding-window", window=24, num_features=4, global_tokens=1, seed=0)
    report = embedding_report(teacher, student, tokenizer, _text(60), max_length=128)
    short = report.buckets[0]
    assert short["count"] > 0 and short["min"] == pytest.approx(1.0, abs=1e-9)  # <= 25 tokens: all keys exact
    assert report.passages["128"]["mean"] < 1 - 1e-6


# ---------------------------------------------------------------------- end-to-end stage
def _passages(tokenizer, count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    from kernelattn_core.workloads import minilm

    batch = minilm.random_passages(tokenizer, _text(80, seed=seed), length=48, count=count, seed=seed)
    return [{k: v[i : i + 1] for k, v in batch.items()} for i in range(count)]


def test_random_passages_cut_the_requested_part_at_seeded_offsets(tokenizer) -> None:
    from kernelattn_core.workloads import minilm

    text = _text(80)
    a = minilm.random_passages(tokenizer, text, length=20, count=6, seed=3, part=(0.0, 0.5))
    b = minilm.random_passages(tokenizer, text, length=20, count=6, seed=3, part=(0.0, 0.5))
    assert torch.equal(a["input_ids"], b["input_ids"]) and a["attention_mask"].all()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    first_half = " ".join(map(str, ids[: len(ids) // 2]))
    for row in a["input_ids"]:
        assert " ".join(map(str, row[1:-1].tolist())) in first_half
    assert len({tuple(r.tolist()) for r in a["input_ids"]}) > 1  # offsets differ
    with pytest.raises(ka.InputError, match="part"):
        minilm.random_passages(tokenizer, text, part=(0.5, 0.5))


def test_end_to_end_lowers_the_validation_loss_and_merges_adapters(tokenizer) -> None:
    from kernelattn_core.convert.e2e import finetune_end_to_end

    teacher = tiny()
    student = convert_attention(teacher, "sliding-window", window=2, num_features=6, global_tokens=1, seed=0)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    train, val = _passages(tokenizer, 12, 0), _passages(tokenizer, 2, 1)
    report = finetune_end_to_end(
        student, teacher, train, validation=val, steps=24, lr=5e-3, lora_rank=2, eval_every=6, progress=False
    )
    assert report.loss_after < 0.9 * report.loss_before
    assert report.parameters > 0 and report.best_step > 0
    after = student.state_dict()
    assert set(after) == set(before)  # adapters merged: the state dict keeps its keys
    assert any(not torch.equal(before[k], after[k]) for k in before if k.endswith("query.weight"))
    assert all(
        not isinstance(m.query, torch.nn.Module) or type(m.query) is torch.nn.Linear
        for _, m in converted_modules(student)
    )
    assert all(p.requires_grad for p in student.parameters())  # flags restored
    # the reported loss is the loss of the kept parameters
    from kernelattn_core.convert.e2e import _hidden, _loss

    with torch.no_grad():
        again = sum(float(_loss(student, _hidden(teacher, b), b, 1.0, 1.0)) for b in val) / len(val)
    assert again == pytest.approx(report.loss_after, rel=1e-9)
    # the teacher is untouched
    assert all(not isinstance(m, ka.KernelAttention) for m in teacher.modules())


def test_nothing_at_a_padded_position_reaches_the_embedding_or_the_end_to_end_loss() -> None:
    from kernelattn_core.convert.e2e import _loss
    from kernelattn_core.workloads.minilm import mean_pool

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    poisoned = hidden.clone()
    poisoned[0, 3:] = float("nan")
    assert torch.equal(mean_pool(poisoned, mask), mean_pool(hidden, mask))
    assert torch.allclose(mean_pool(hidden, mask)[0], hidden[0, :3].mean(0))

    class Fixed(torch.nn.Module):  # a "student" whose hidden states are given, NaN where padded
        def __init__(self, states: tuple[torch.Tensor, ...]) -> None:
            super().__init__()
            self.states = states

        def forward(self, **_: object) -> object:
            return type("Out", (), {"hidden_states": (None, *self.states)})()

    teacher_states = (hidden + 0.1, hidden - 0.2)
    batch = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": mask}
    clean = _loss(Fixed((hidden, hidden)), teacher_states, batch, 1.0, 1.0)
    dirty = _loss(Fixed((poisoned, poisoned)), teacher_states, batch, 1.0, 1.0)
    assert torch.isfinite(clean) and float(clean) > 0 and torch.equal(clean, dirty)


def test_end_to_end_without_adapters_trains_only_the_estimators(tokenizer) -> None:
    from kernelattn_core.convert.e2e import finetune_end_to_end

    teacher = tiny()
    student = convert_attention(teacher, "sliding-window", window=2, num_features=6, global_tokens=1, seed=0)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    finetune_end_to_end(student, teacher, _passages(tokenizer, 4, 0), steps=4, lr=1e-2, progress=False)
    changed = {k for k in before if not torch.equal(before[k], student.state_dict()[k])}
    assert changed and all(".estimator." in k for k in changed)


def test_end_to_end_argument_errors(tokenizer) -> None:
    from kernelattn_core.convert.e2e import finetune_end_to_end

    teacher = tiny()
    student = convert_attention(teacher, "sliding-window", window=2, num_features=6, seed=0)
    batches = _passages(tokenizer, 2, 0)
    with pytest.raises(ka.InputError, match="student: no converted attention layer"):
        finetune_end_to_end(teacher, teacher, batches)
    with pytest.raises(ka.InputError, match="batches: expected at least one"):
        finetune_end_to_end(student, teacher, [])
    with pytest.raises(ka.InputError, match="batches: expected dicts"):
        finetune_end_to_end(student, teacher, [torch.zeros(1, 4, dtype=torch.long)])
    with pytest.raises(ka.InputError, match="lr"):
        finetune_end_to_end(student, teacher, batches, lr=0.0)
    with pytest.raises(ka.InputError, match="anchor"):
        finetune_end_to_end(student, teacher, batches, anchor=float("nan"))
    with pytest.raises(ka.InputError, match="lora_rank"):
        finetune_end_to_end(student, teacher, batches, lora_rank=-1)


def test_adapters_refuse_torch_attention_modules() -> None:
    from kernelattn_core.convert.e2e import finetune_end_to_end

    layer = torch.nn.TransformerEncoderLayer(8, 2, batch_first=True)
    student = convert_attention(torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False), "elu")
    batch = {"input_ids": torch.zeros(1, 3, dtype=torch.long), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    with pytest.raises(ka.InputError, match="lora_rank: adapters go on Hugging Face layers' q/k/v projections"):
        finetune_end_to_end(student, student, [batch], steps=1, lora_rank=2)


# ---------------------------------------------------------------------- allocation
def test_allocation_keeps_the_budget_and_the_best_validated_split(tokenizer) -> None:
    from kernelattn_core.convert.allocate import allocate_budget, splits

    assert splits(20, (2, 4, 9), global_tokens=1) == [(2, 14), (4, 10)]  # 2w + 1 + 1 + D <= 20, D even >= 2
    teacher = tiny()
    options = {"global_tokens": 1, "seed": 0}
    student = convert_attention(teacher, "sliding-window", window=2, num_features=14, **options)
    fit = _passages(tokenizer, 2, 0)
    val = _passages(tokenizer, 1, 1)
    chosen = allocate_budget(
        student, teacher, fit, val, options=options, budget=20, windows=(2, 4), steps=5, progress=False
    )
    assert len(chosen) == 2
    for layer, (_, module) in zip(chosen, converted_modules(student)):
        assert layer["budget"] <= 20
        best = min(layer["candidates"], key=lambda c: c["validation_error"])
        assert (layer["window"], layer["num_features"]) == (best["window"], best["num_features"])
        assert module.estimator.window == layer["window"] and module.estimator.num_features == layer["num_features"]
    report = distill_attention(student, teacher, fit, steps=2, progress=False)  # the chosen estimators go on fitting
    assert len(report.layers) == 2
    with pytest.raises(ka.InputError, match="windows"):
        allocate_budget(student, teacher, fit, val, options=options, budget=6, windows=(4,), steps=1, progress=False)


def test_allocation_with_heavy_keys_keeps_the_budget_and_installs_the_best(tokenizer) -> None:
    from kernelattn_core.convert.allocate import allocate_budget, split_candidates

    # 2w + 1 + g + s + D <= 20 with D even >= 2, for every heavy count s
    assert split_candidates(20, (2, 4), 1, (0, 3)) == [(2, 0, 14), (4, 0, 10), (2, 3, 10), (4, 3, 6)]
    teacher = tiny()
    options = {"global_tokens": 1, "seed": 0}
    student = convert_attention(teacher, "sliding-window", window=2, num_features=14, **options)
    fit, val = _passages(tokenizer, 2, 0), _passages(tokenizer, 1, 1)
    chosen = allocate_budget(
        student, teacher, fit, val, options=options, budget=20, windows=(2,), heavy=(0, 3), steps=5, progress=False
    )
    for layer, (_, module) in zip(chosen, converted_modules(student), strict=True):
        assert [(c["window"], c["heavy_keys"], c["num_features"]) for c in layer["candidates"]] == [
            (2, 0, 14),
            (2, 3, 10),
        ]
        best = min(layer["candidates"], key=lambda c: c["validation_error"])
        assert layer["heavy_keys"] == best["heavy_keys"] and layer["budget"] <= 20
        assert module.estimator.heavy_keys == layer["heavy_keys"]
        assert module.estimator.budget() == layer["budget"]
    # the estimator's own heavy_keys option is the one candidate unless candidates are given
    fixed = allocate_budget(
        student,
        teacher,
        fit,
        val,
        options={**options, "heavy_keys": 3},
        budget=20,
        windows=(2,),
        steps=1,
        progress=False,
    )
    assert [c["heavy_keys"] for c in fixed[0]["candidates"]] == [3]
    with pytest.raises(ka.InputError, match="heavy"):
        allocate_budget(
            student,
            teacher,
            fit,
            val,
            options={**options, "heavy_keys": 3},
            heavy=(0,),
            budget=20,
            windows=(2,),
            steps=1,
            progress=False,
        )


# ---------------------------------------------------------------------- the command line
def test_cli_runs_every_stage_and_reports_the_new_columns(tokenizer, tmp_path, capsys) -> None:
    import json

    from kernelattn_core.cli.main import main

    model = tiny(positions=64).float()
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    fit, held = tmp_path / "fit.txt", tmp_path / "held.txt"
    fit.write_text(_text(60, seed=1))
    held.write_text(_text(40, seed=2))
    args = ["convert", str(tmp_path / "m"), "--estimator", "sliding-window", "--option", "global_tokens=1"]
    args += ["--option", "seed=0", "--window", "2", "--budget", "14", "--fit-texts", str(fit)]
    args += ["--eval-texts", str(held), str(fit), "--max-length", "48", "--steps", "3", "--rows", "8"]
    args += ["--allocate", "20", "--allocate-windows", "2,4", "--allocate-steps", "2", "--e2e-steps", "3"]
    args += ["--allocate-heavy", "0,3"]
    args += [
        "--e2e-length",
        "24,48",
        "--lora-rank",
        "1",
        "--sentences",
        "12",
        "--passages",
        "2",
        "--format",
        "json",
        "--no-progress",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    # the second evaluation text is the fitting text; the first is held out (no warning)
    assert f"100.0% of the sentences of --eval-texts {str(fit)!r} are also in the fitting text" in captured.err
    assert str(held) not in captured.err
    records = json.loads(captured.out)
    layers, summary = records[:-1], records[-1]
    assert [r["window"] for r in layers] == [a["window"] for a in summary["allocation"]]
    assert [r["heavy_keys"] for r in layers] == [a["heavy_keys"] for a in summary["allocation"]]
    assert all(a["heavy_keys"] in (0, 3) for a in summary["allocation"])
    assert all(a["budget"] <= 20 for a in summary["allocation"])
    assert all(r["output_rel_error"] == max(r[f"output_rel_error_{t}"] for t in (str(held), str(fit))) for r in layers)
    assert summary["held_out_overlap"] == {str(held): 0.0, str(fit): 1.0}
    assert summary["e2e_steps"] == 3 and summary["e2e_loss_after"] <= summary["e2e_loss_before"]
    assert [e["text"] for e in summary["embeddings"]] == [str(held), str(fit)]
    first = summary["embeddings"][0]
    assert first["cos_26_127_count"] > 0 and 0 < first["cos_26_127_mean"] <= 1
    assert first["passage512_count"] == 0 and summary["passage512_mean"] is None  # 48 positions: no 512 passage
    assert summary["nn_agreement"] == min(e["nn_agreement"] for e in summary["embeddings"])


def test_overlap_warning_never_rounds_a_positive_share_to_zero() -> None:
    from kernelattn_core.cli.convert_cmd import _share

    assert _share(1.0) == "100.0%" and _share(0.004) == "0.4%" and _share(0.0004) == "under 0.1%"


def test_summary_takes_the_worst_text_whatever_the_order_of_a_text_without_passages() -> None:
    from kernelattn_core.cli.convert_cmd import _worst

    assert _worst([math.nan, 0.9, 0.95]) == 0.9 and _worst([0.95, 0.9, math.nan]) == 0.9
    assert _worst([None, 0.97]) == 0.97 and math.isnan(_worst([math.nan, None]))


def test_distill_reports_embeddings_on_the_evaluation_texts(tokenizer) -> None:
    teacher = tiny()
    student = convert_attention(teacher, "sliding-window", window=2, num_features=6, global_tokens=1, seed=0)
    fit = _passages(tokenizer, 2, 0)
    report = distill_attention(
        student, teacher, fit, steps=2, progress=False, eval_texts={"held": _text(30, seed=5)}, tokenizer=tokenizer
    )
    assert [e.text for e in report.embeddings] == ["held"]
    assert report.embeddings[0].passages["128"]["count"] > 0 and report.embeddings[0].headline < 1 - 1e-6
    assert not report.embeddings[0].buckets[0]["count"] == 0
    with pytest.raises(ka.InputError, match="tokenizer"):
        distill_attention(student, teacher, fit, steps=1, progress=False, eval_texts=["legal"])


# ---------------------------------------------------------------------- the speed script (no timing judged here)
def test_best_time_warms_up_once_and_keeps_the_fastest_call() -> None:
    from kernelattn_core.convert import speed

    calls = []
    clock = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])  # three timed calls of 3 s, 1 s and 2 s

    def fn() -> None:
        calls.append(1)

    real = speed.time.perf_counter
    speed.time.perf_counter = lambda: next(clock)
    try:
        assert speed.best_time(fn, repeats=3) == 1.0
    finally:
        speed.time.perf_counter = real
    assert len(calls) == 4  # one warm-up, three timed


def test_attention_timing_rows_and_the_command(capsys) -> None:
    from kernelattn_core.convert import speed

    rows = speed.time_attention(lengths=(32, 64), heads=2, head_dim=8, repeats=1)
    assert [r["length"] for r in rows] == [32, 64]
    for r in rows:
        assert r["estimator_s"] > 0 and r["sdpa_s"] > 0 and r["eager_s"] > 0
        assert r["speedup_vs_sdpa"] == pytest.approx(r["sdpa_s"] / r["estimator_s"])
        assert r["speedup_vs_eager"] == pytest.approx(r["eager_s"] / r["estimator_s"])
    assert speed.main(["--skip-models", "--lengths", "48", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "speedup_vs_sdpa" in out and "48" in out


def test_attention_timing_of_the_heavy_key_recipe(capsys, monkeypatch) -> None:
    from kernelattn_core.convert import speed

    built = []
    real_create = ka.create

    def spy(name, **options):  # type: ignore[no-untyped-def]
        est = real_create(name, **options)
        built.append(est)
        return est

    monkeypatch.setattr(ka, "create", spy)
    assert speed.HEAVY_RECIPE["num_features"] + speed.HEAVY_RECIPE["heavy_keys"] == speed.RECIPE["num_features"]
    assert speed.main(["--skip-models", "--lengths", "40", "--repeats", "1", "--recipe", "heavy"]) == 0
    assert built[-1].heavy_keys == 64 and built[-1].budget() == 128
    assert "speedup_vs_sdpa" in capsys.readouterr().out
