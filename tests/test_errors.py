"""Bad input gets a clear error naming the argument, the expected and the actual value."""

from __future__ import annotations

import pytest
import torch

import kernelattn_core as ka

from .conftest import qkv


@pytest.fixture(params=["softmax", "elu", "toy-prf"])
def est(request, use_registry):  # type: ignore[no-untyped-def]
    return ka.create(request.param)


def test_mismatched_head_dimensions(est) -> None:  # type: ignore[no-untyped-def]
    q, _, v = qkv(d=8)
    _, k, _ = qkv(d=6)
    with pytest.raises(ka.InputError, match=r"k: expected head dimension d = 8 .*got 6"):
        est(q, k, v)


def test_dtype_mismatch(est) -> None:  # type: ignore[no-untyped-def]
    q, k, v = qkv()
    with pytest.raises(ka.InputError, match=r"k: expected the dtype of q \(torch.float64\), got torch.float32"):
        est(q, k.float(), v)


def test_integer_tensors(est) -> None:  # type: ignore[no-untyped-def]
    q, k, v = qkv()
    with pytest.raises(ka.InputError, match=r"q: expected a floating-point tensor .* got dtype torch.int64"):
        est(q.long(), k, v)


def test_wrong_rank(est) -> None:  # type: ignore[no-untyped-def]
    q, k, v = qkv()
    with pytest.raises(
        ka.InputError, match=r"q: expected a 4-D tensor of shape \[B, H, N, d\], got shape \(3, 13, 8\)"
    ):
        est(q[0], k, v)


def test_value_length_mismatch(est) -> None:  # type: ignore[no-untyped-def]
    q, k, v = qkv()
    with pytest.raises(ka.InputError, match=r"v: expected leading dimensions \[B, H, M\] = \[2, 3, 13\]"):
        est(q, k, v[:, :, :5])


def test_mask_of_wrong_shape(est) -> None:  # type: ignore[no-untyped-def]
    q, k, v = qkv()
    with pytest.raises(ka.InputError, match=r"key_padding_mask: expected shape \[B, M\] = \[2, 13\], got \[2, 12\]"):
        est(q, k, v, key_padding_mask=torch.zeros(2, 12, dtype=torch.bool))


def test_mask_of_wrong_dtype(est) -> None:  # type: ignore[no-untyped-def]
    q, k, v = qkv()
    with pytest.raises(ka.InputError, match=r"key_padding_mask: expected dtype torch.bool .*got torch.float32"):
        est(q, k, v, key_padding_mask=torch.zeros(2, 13))


def test_causal_needs_square_attention(est) -> None:  # type: ignore[no-untyped-def]
    q, k, v = qkv(n=4, m=6)
    with pytest.raises(ka.InputError, match=r"causal: expected as many queries as keys .* N = 4, M = 6"):
        est(q, k, v, causal=True)


def test_non_tensor_input(est) -> None:  # type: ignore[no-untyped-def]
    _, k, v = qkv()
    with pytest.raises(ka.InputError, match="q: expected a torch.Tensor"):
        est([1.0], k, v)


def test_kernel_attention_needs_an_estimator() -> None:
    q, k, v = qkv()
    with pytest.raises(ka.InputError, match="estimator: expected an AttentionEstimator.*got str"):
        ka.kernel_attention(q, k, v, "softmax")  # type: ignore[arg-type]


def test_num_features_must_be_a_positive_int(use_registry) -> None:
    with pytest.raises(ka.InputError, match="num_features: expected an integer >= 1, got 0"):
        ka.create("toy-prf", num_features=0)
    with pytest.raises(ka.InputError, match=r"num_features: expected an integer >= 1, got 2.5 \(float\)"):
        ka.create("toy-prf", num_features=2.5)


def test_create_refuses_a_normalizer_name() -> None:
    with pytest.raises(ka.UnknownNameError, match="'row' is a normalizer"):
        ka.create("row")


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("matern", {"nu": float("inf")}, r"nu: expected one of 1/2, 3/2, 5/2 .*got inf"),
        ("hedgehog", {"init_scale": float("nan")}, r"init_scale: expected a finite number >= 0, got nan"),
        ("hedgehog", {"init_scale": float("inf")}, r"init_scale: expected a finite number >= 0, got inf"),
        ("cexp", {"eps": float("inf")}, r"eps: expected a finite positive number, got inf"),
        ("hcexp", {"eps": float("inf")}, r"eps: expected a finite positive number, got inf"),
        ("rmf", {"check": "no"}, r"check: expected True or False, got 'no' \(str\)"),
        ("rmfa", {"check": 1}, r"check: expected True or False, got 1 \(int\)"),
        ("rmf", {"kernel_options": 0}, r"kernel_options: expected a dict of the kernel's options, got 0"),
        ("rmfa", {"kernel_options": "bogus"}, r"kernel_options: expected a dict of the kernel's options, got 'bogus'"),
    ],
)
def test_plugin_options_refused_naming_the_option(name: str, options: dict, match: str) -> None:
    """Values that built an estimator and then gave NaN (an infinite scale or epsilon), were
    read by their truth value (``check="no"``), or failed inside the standard library."""
    with pytest.raises(ka.InputError, match=match):
        ka.create(name, **options)
