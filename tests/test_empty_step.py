"""A decoding step of no new position (``T = 0``): an empty output, and the state carried
as it is, for every registered estimator with a ``step`` and for ``KernelAttention.step``
(its key-value cache path sliced ``out[:, :, -0:]``, every row, and the log-space maps'
stabiliser reduced over no key, before)."""

from __future__ import annotations

import warnings

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.errors import InputError, UnknownNameError
from kernelattn_core.interfaces.estimator import supports_step


def _stepping() -> list[str]:
    out = []
    for name in sorted(ka.get_registry().names()):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                est = ka.create(name, head_dim=8)
        except (UnknownNameError, InputError):
            continue  # a normaliser, or an estimator without a head_dim option
        if supports_step(est):
            out.append(name)
    return out


STEPPING = _stepping()


def test_the_estimators_with_a_step_are_found() -> None:
    assert {"prf", "elu", "hedgehog", "rff", "sliding-window", "schoenbat"} <= set(STEPPING)


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("name", STEPPING)
def test_an_empty_step_returns_no_row_and_carries_the_state(name: str, grad: bool) -> None:
    torch.manual_seed(0)
    est = ka.create(name, head_dim=8).double()
    q, q2 = (torch.randn(1, 2, t, 8, dtype=torch.float64) for t in (5, 3))
    empty = torch.randn(1, 2, 0, 8, dtype=torch.float64)
    with torch.set_grad_enabled(grad):
        out0, first = est.step(empty, empty, empty, None)  # a sequence may start empty
        _, state = est.step(q, q, q, first)
        _, ref_state = est.step(q, q, q, None)
        out_e, carried = est.step(empty, empty, empty, state)
        after, _ = est.step(q2, q2, q2, carried)
        ref, _ = est.step(q2, q2, q2, ref_state)
    assert tuple(out0.shape) == tuple(out_e.shape) == (1, 2, 0, 8)
    torch.testing.assert_close(after, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["softmax", "prf", "sliding-window"])
def test_module_step_of_no_position(name: str) -> None:
    attn = ka.KernelAttention(16, 2, name, causal=True, batch_first=True).double()
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    _, state = attn.step(x)
    out, state = attn.step(x[:, :0], state)
    assert tuple(out.shape) == (1, 0, 16)
    nxt, _ = attn.step(x[:, :1], state)
    full, _ = attn(torch.cat([x, x[:, :1]], 1), is_causal=True)
    torch.testing.assert_close(nxt, full[:, -1:], rtol=1e-10, atol=1e-10)
