"""Training under bfloat16 autocast on the decoding-state path.

A converted Hugging Face decoder trained with ``use_cache=True`` (Llama's default) runs
its estimator's ``step`` (:meth:`KernelStateLayer.attend
<kernelattn_core.convert.cache.KernelStateLayer.attend>`), and so the chunked causal core
with its own backward (:mod:`kernelattn_core.engine.chunked`). Under autocast its forward
products were bfloat16 and its backward's float32: ``RuntimeError: expected scalar type
Float but found BFloat16``. The core now computes in its inputs' dtype (float32 for half
inputs) with autocast off, as the grouped engine of the ``use_cache=False`` path does.
"""

from __future__ import annotations

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.engine.chunked import causal_linear_attention

transformers = pytest.importorskip("transformers")


def _tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=48,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).float()


@pytest.mark.parametrize(
    ("name", "options"), [("prf", {"num_features": 8, "seed": 0}), ("hedgehog", {"num_features": 8})]
)
def test_a_bf16_autocast_training_step_with_a_cache_equals_one_without(name: str, options: dict) -> None:
    model = ka.convert_attention(_tiny_llama(), name, **options).train()
    ids = torch.randint(3, 48, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for use_cache in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=use_cache).loss
        loss.backward()  # use_cache=True raised in the chunked core's backward
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_plain, grads_plain), (loss_cache, grads_cache) = results
    torch.testing.assert_close(loss_cache, loss_plain, rtol=1e-5, atol=1e-6)
    assert grads_cache.keys() == grads_plain.keys()
    for n, grad in grads_plain.items():
        assert bool(torch.isfinite(grads_cache[n]).all()), n
        # both paths run the estimator in float32 under autocast: equal up to summation order
        torch.testing.assert_close(grads_cache[n], grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("log_space", [False, True])
def test_the_chunked_core_ignores_autocast_in_its_forward_and_backward(log_space: bool) -> None:
    """Called under autocast (as an estimator's ``step`` is), the core's output, final state
    and gradients equal those of the call without autocast; before, the backward raised."""
    g = torch.Generator().manual_seed(2)
    b, h, n, d, dv = 2, 2, 21, 4, 3
    q, k, v = (torch.rand(b, h, n, w, generator=g) for w in (d, d, dv))
    s0 = torch.rand(b, h, d, dv, generator=g)
    m = m0 = None
    if log_space:  # a non-decreasing stabiliser, the initial state's at or below it
        m = torch.randn(b, h, n, generator=g).cummax(-1).values.contiguous()
        m0 = m[..., :1] - 0.5
    results = []
    for autocast in (False, True):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, s0)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, s_final = causal_linear_attention(*inputs, m, m0, 8)
            loss = (out * out.detach()).sum() + s_final.sum()  # a loss computed under autocast too
        loss.backward()
        results.append((out.detach(), s_final.detach(), *(t.grad for t in inputs)))
    assert results[1][0].dtype == torch.float32
    for got, ref in zip(results[1], results[0]):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
