"""The finite decoding step of feature-map attention (``FeatureMapAttention._step_finite`` on
``engine.torch_backend.decode_one_finite``): every position of a decode equals the guarded
step's (outputs and states), the short path is taken where it applies, and every input it
must not handle (non-finite values, padding, autograd, a tiny denominator, a state of
another estimator) goes to the guarded path. CI cost: about 2 s."""

from __future__ import annotations

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.builtins import estimators as estimators_module
from kernelattn_core.engine.chunked import CausalState
from kernelattn_core.errors import InputError

B, H, N, D_HEAD, DV = 2, 3, 12, 8, 5
PREFILL = 3
# log-space (prf, hedgehog), plain positive (elu) and signed (rff) features
ESTIMATORS = [
    ("prf", {"num_features": 16}),
    ("hedgehog", {"num_features": 16}),
    ("elu", {}),
    ("rff", {"num_features": 16}),
]


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per call of the short path: whether it returned (True) or declined (False)."""
    calls: list[bool] = []
    real = estimators_module.decode_one_finite

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = real(*args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(estimators_module, "decode_one_finite", counting)
    return calls


def _est(name: str, options: dict, dtype: torch.dtype) -> torch.nn.Module:
    est = ka.create(name, seed=3, head_dim=D_HEAD, **options).to(dtype)
    return est.eval()


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, N, D_HEAD, generator=g, dtype=dtype) for _ in range(2))
    return q, k, torch.randn(B, H, N, DV, generator=g, dtype=dtype)


def _decode(est, q, k, v, *, guarded: bool = False, mask: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
    """Prefill PREFILL positions, then one position per step; ``guarded`` switches the short
    path off (the reference). Returns the outputs ``[B, H, N, dv]`` and the last state."""
    if guarded:
        est._step_finite = lambda *args: None  # the instance attribute shadows the method
    try:
        cut = (lambda a, b: None) if mask is None else (lambda a, b: mask[:, a:b])
        with torch.no_grad():
            out, state = est.step(
                q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL], key_padding_mask=cut(0, PREFILL)
            )
            outs = [out]
            for t in range(PREFILL, N):
                one = slice(t, t + 1)
                out, state = est.step(q[:, :, one], k[:, :, one], v[:, :, one], state, key_padding_mask=cut(t, t + 1))
                outs.append(out)
    finally:
        if guarded:
            del est._step_finite
    return torch.cat(outs, 2), state


def _meaning(state: CausalState) -> torch.Tensor:
    """The state independent of its stabiliser: S / sum(z) (plain features: S itself)."""
    return state.kv / state.z.sum(-1)[..., None, None]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("name", "options"), ESTIMATORS)
def test_short_path_equals_the_guarded_step(name: str, options: dict, dtype: torch.dtype, taken: list[bool]) -> None:
    est = _est(name, options, dtype)
    q, k, v = _inputs(dtype)
    ref, ref_state = _decode(est, q, k, v, guarded=True)
    assert taken == []
    got, state = _decode(est, q, k, v)
    assert taken == [True] * (N - PREFILL)  # every one-position step after the prefill
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-6}
    torch.testing.assert_close(got, ref, **tol)
    assert state.length == ref_state.length == N and state.poisoned is None
    torch.testing.assert_close(_meaning(state), _meaning(ref_state), **tol)
    assert state.owner == ref_state.owner
    # the decode is the causal forward's rows (the short path is no second definition)
    with torch.no_grad():
        full = est(q, k, v, causal=True)
    torch.testing.assert_close(got, full, **tol)


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize(("name", "options"), ESTIMATORS[:3])
def test_non_finite_inputs_go_to_the_guarded_step(name: str, options: dict, where: str, taken: list[bool]) -> None:
    est = _est(name, options, torch.float64)
    q, k, v = _inputs(torch.float64, seed=1)
    t = PREFILL + 4
    {"q": q, "k": k, "v": v}[where][1, 2, t, 0] = float("nan")
    ref, ref_state = _decode(est, q, k, v, guarded=True)
    taken.clear()
    got, state = _decode(est, q, k, v)
    assert torch.equal(got.isnan(), ref.isnan())
    assert bool(got.isnan().any())  # the NaN reached the rows the guarded step poisons, no others
    torch.testing.assert_close(got[~ref.isnan()], ref[~ref.isnan()], rtol=1e-12, atol=1e-12)
    assert (state.poisoned is None) == (ref_state.poisoned is None)
    if where == "q":  # a query poisons its own row only: the state stays clean, later steps go short again
        assert ref_state.poisoned is None
        assert taken == [True] * 4 + [False] + [True] * (N - t - 1)
    else:  # a key or value poisons the state: every later step is guarded
        assert bool(ref_state.poisoned[1, 2]) and int(ref_state.poisoned.sum()) == 1
        assert taken == [True] * 4 + [False]


def test_padding_autograd_and_tiny_denominators_take_the_guarded_step(taken: list[bool]) -> None:
    est = _est("prf", {"num_features": 16}, torch.float64)
    q, k, v = _inputs(torch.float64, seed=2)
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[0, 6] = True
    ref, ref_state = _decode(est, q, k, v, guarded=True, mask=mask)
    got, state = _decode(est, q, k, v, mask=mask)
    # a mask that pads nothing at a step (batched generation passes one every step) takes the
    # short path; the step that pads a key (t = 6) is the guarded path's
    assert taken == [True] * (N - PREFILL - 1)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_meaning(state), _meaning(ref_state), rtol=1e-12, atol=1e-12)
    taken.clear()

    # a prefill whose keys are all padded in one row (stabiliser -inf), then steps without a mask
    pad = torch.zeros(B, PREFILL, dtype=torch.bool)
    pad[0] = True
    outs = []
    for guarded in (True, False):
        if guarded:
            est._step_finite = lambda *args: None
        with torch.no_grad():
            _, state = est.step(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL], key_padding_mask=pad)
            assert bool(torch.isinf(state.m[0]).all())
            rows = []
            for t in range(PREFILL, N):
                out, state = est.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
                rows.append(out)
        if guarded:
            del est._step_finite
        outs.append(torch.cat(rows, 2))
    assert taken == [True] * (N - PREFILL)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    taken.clear()

    with torch.no_grad():
        _, state = est.step(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL])
    one = slice(PREFILL, PREFILL + 1)
    with torch.enable_grad():
        out, _ = est.step(q[:, :, one], k[:, :, one], v[:, :, one], state)
    assert taken == [] and out.shape == (B, H, 1, DV)

    # a normaliser whose eps exceeds every denominator: the short path must decline (its
    # num / den would differ from the guarded rule, which divides by +-eps)
    big = _est("prf", {"num_features": 16}, torch.float64)
    big.normalizer = type(big.normalizer)(eps=1e6)
    ref, _ = _decode(big, q, k, v, guarded=True)
    got, _ = _decode(big, q, k, v)
    assert taken == [False] * (N - PREFILL)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_a_state_or_input_it_cannot_continue_is_refused_as_before(taken: list[bool]) -> None:
    small, est = _est("prf", {"num_features": 8}, torch.float64), _est("prf", {"num_features": 16}, torch.float64)
    q, k, v = _inputs(torch.float64, seed=3)
    with torch.no_grad():
        _, foreign = small.step(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL])
        _, own = est.step(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL])
        one = slice(PREFILL, PREFILL + 1)
        with pytest.raises(InputError, match="state"):
            est.step(q[:, :, one], k[:, :, one], v[:, :, one], foreign)
        with pytest.raises(InputError, match="q: expected a 4-D tensor"):
            est.step(q[:, :, PREFILL], k[:, :, one], v[:, :, one], own)
        with pytest.raises(InputError, match="k: expected the dtype of q"):
            est.step(q[:, :, one], k[:, :, one].float(), v[:, :, one], own)
        with pytest.raises(InputError, match="v: expected leading dimensions"):
            est.step(q[:, :, one], k[:, :, one], v[:1, :, one], own)
    assert taken == []


def test_a_scale_or_eps_changed_between_steps_is_read_at_each_step(taken: list[bool]) -> None:
    q, k, v = _inputs(torch.float64, seed=4)
    outs = []
    for guarded in (True, False):
        est = _est("prf", {"num_features": 16}, torch.float64)
        if guarded:
            est._step_finite = lambda *args: None
        rows = []
        with torch.no_grad():
            _, state = est.step(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL])
            for t in range(PREFILL, N):
                if t == 7:
                    est.scale = 0.05  # from 1/sqrt(d) = 0.35: the logits shrink from here on
                out, state = est.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
                rows.append(out)
        outs.append(torch.cat(rows, 2))
    assert taken == [True] * (N - PREFILL)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)


def test_a_key_above_the_stabiliser_raises_it_and_others_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The short step adds a key at the state's stabiliser as it is (no rescaling of the sums)
    and redoes the step with the stabiliser raised (absorb_one_finite) only for a key whose
    features exceed it: equal to the guarded step either way."""
    from kernelattn_core.engine import torch_backend

    raised: list[int] = []
    real = torch_backend.absorb_one_finite

    def counting(state, phi_k, v, *, log_space):  # type: ignore[no-untyped-def]
        raised.append(state.length)
        return real(state, phi_k, v, log_space=log_space)

    monkeypatch.setattr(torch_backend, "absorb_one_finite", counting)
    est = _est("hedgehog", {"num_features": 16}, torch.float64)
    q, k, v = _inputs(torch.float64, seed=5)
    _decode(est, q, k, v)
    plain = set(raised)  # the positions (state lengths) at which a key raised it
    t = max(set(range(PREFILL + 2, N)) - plain)
    k[:, :, t] *= 4.0  # its log-features (+-(w.k + b)) reach far above every other key's
    ref, ref_state = _decode(est, q, k, v, guarded=True)
    raised.clear()
    got, state = _decode(est, q, k, v)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(state.m, ref_state.m)
    torch.testing.assert_close(_meaning(state), _meaning(ref_state), rtol=1e-12, atol=1e-12)
    assert t in raised and not [n for n in raised if n > t]  # raised by the large key, by none after it
    assert len(raised) < N - PREFILL  # the other keys were added at the stabiliser as it was


def _tiny_gpt2(name: str, options: dict) -> torch.nn.Module:
    """A random-weight GPT-2 (2 layers, width 32) converted to ``name``."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    return ka.convert_attention(transformers.GPT2LMHeadModel(config).eval(), name, **options).eval()


def _generate_guarded_then_short(model: torch.nn.Module, **kwargs: object) -> list[torch.Tensor]:
    """``model.generate(**kwargs)`` with the short paths switched off, then on."""
    runs = []
    for guarded in (True, False):
        for layer in model.transformer.h:
            if guarded:
                layer.attn.estimator._step_finite = lambda *args: None
            else:
                layer.attn.estimator.__dict__.pop("_step_finite", None)
        with torch.no_grad():
            runs.append(model.generate(max_new_tokens=6, do_sample=False, pad_token_id=0, **kwargs))
    return runs


def test_batched_generation_with_left_padding_takes_the_short_path(taken: list[bool]) -> None:
    """transformers passes the attention mask at every step of batched generation; where it
    pads none of the new positions the short path runs (it did not: every token of a
    left-padded batch took the guarded step), with the same tokens as the guarded step."""
    model = _tiny_gpt2("prf", {"num_features": 16})
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4], ids[0, :4] = 0, 0  # the first prompt is left-padded
    guarded, short = _generate_guarded_then_short(model, input_ids=ids, attention_mask=mask)
    assert taken == [True] * (5 * 2)  # 5 one-token steps after the prompt, 2 layers
    assert torch.equal(short, guarded)


@pytest.mark.parametrize("name", ["prf", "sliding-window"])
def test_beam_search_takes_the_short_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A beam search reorders the cache at every step, which restates each state's owner (an
    equal copy, another object): the short path took only the owner the estimator stated
    itself, so every beam step ran the guarded step. Same sequences as the guarded path."""
    from kernelattn_hybrid import estimator as hybrid_module

    calls: list[bool] = []
    for module, attr in ((estimators_module, "decode_one_finite"), (hybrid_module, "window_step_finite")):
        real = getattr(module, attr)

        def counting(*args, _real=real, **kwargs):  # type: ignore[no-untyped-def]
            result = _real(*args, **kwargs)
            calls.append(result is not None)
            return result

        monkeypatch.setattr(module, attr, counting)
    options = {"window": 8, "num_features": 8} if name == "sliding-window" else {"num_features": 16}
    model = _tiny_gpt2(name, options)
    ids = torch.randint(3, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    guarded, short = _generate_guarded_then_short(model, input_ids=ids, num_beams=3)
    assert calls == [True] * (5 * 2)  # every one-token step of both layers (after the prompt) went short
    assert torch.equal(short, guarded)
