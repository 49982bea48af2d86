"""A redraw of ``rmfa`` / ``schoenbat`` under ``torch.inference_mode()`` (the module left in
training mode) leaves ordinary buffers: the next training step, ``load_state_dict`` and a
differentiable eval call work, and the draws equal those of a redraw outside inference mode.

The map's draw changes shape (``omega`` has ``sum N_i`` rows), so ``_redraw`` assigns new
tensors; made under inference mode they were inference tensors ("Inference tensors
cannot be saved for backward").
"""

from __future__ import annotations

import warnings

import pytest
import torch

import kernelattn_core as ka


def _model(name: str) -> ka.KernelAttention:
    return ka.KernelAttention(16, 2, estimator=name, batch_first=True, num_features=8, seed=0, redraw_every=2)


@pytest.mark.parametrize("name", ["rmfa", "schoenbat"])
def test_redraw_under_inference_mode_leaves_ordinary_buffers(name: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))
    inside, outside = _model(name), _model(name)
    for m in (inside, outside):
        m(x)[0].sum().backward()  # builds the map (schoenbat builds lazily)
        m(x)[0].sum().backward()
    saved = {k: v.clone() for k, v in inside.state_dict().items()}
    with torch.inference_mode():
        inside(x)  # the third training-mode forward: a redraw, under inference mode
    with torch.no_grad():
        outside(x)  # the same redraw outside inference mode
    assert [n for n, b in inside.named_buffers() if b.is_inference()] == []
    fm_in, fm_out = inside.estimator.feature_map, outside.estimator.feature_map
    assert torch.equal(fm_in.degrees, fm_out.degrees)
    assert torch.equal(fm_in.omega, fm_out.omega)
    assert not fm_in.weights.is_inference()
    inside(x)[0].sum().backward()  # a training step
    inside.eval()
    inside(x)[0].sum().backward()  # an eval call under autograd
    inside.train()
    inside.load_state_dict(saved)
    assert torch.equal(inside.estimator.feature_map.omega, saved["estimator.feature_map.omega"])


def test_weights_first_computed_under_inference_mode_are_ordinary() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    m = _model("rmfa")
    x = torch.randn(2, 6, 16)
    fm = m.estimator.feature_map
    with torch.inference_mode():
        m.eval()
        m(x)  # builds nothing new, but may fill the weights cache
        fm.redraw(generator=torch.Generator().manual_seed(3))
        assert fm.weights.numel() == fm.num_features  # fills the cache here
    m.train()
    assert not fm.weights.is_inference()
    assert not fm.omega.is_inference() and not fm.degrees.is_inference()
    m(x.double().float())[0].sum().backward()
