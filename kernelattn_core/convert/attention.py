"""Convert the attention of a model, list the converted modules, reload a converted decoder.

:func:`convert_attention`, :func:`converted_modules` and :func:`from_pretrained`, re-exported
by :mod:`kernelattn_core.convert` (import them from there). They sit in their own module,
above :mod:`~kernelattn_core.convert.decoder` and :mod:`~kernelattn_core.convert.hf` (whose
modules they build) and below :mod:`~kernelattn_core.convert.distill` (which fits them), so
that no module of the package imports the package's ``__init__`` (issue 27: no import circle).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from ..lookup import resolve
from ..module import KernelAttention
from ..validation import check_bool, check_positive_int, check_seed
from .decoder import (
    RECORD,
    KernelDecoderAttention,
    convert_decoder_module,
    decoder_shape,
    finish_conversion,
    is_hf_decoder_attention,
    register,
)
from .hf import HFKernelSelfAttention, is_hf_self_attention
from .hf import _num_heads as _hf_heads

_CONVERTED = (KernelAttention, HFKernelSelfAttention, KernelDecoderAttention)


def __getattr__(name: str) -> Any:
    if name == "KernelCache":  # imports transformers
        from .cache import KernelCache

        return KernelCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def convert_attention(
    model: nn.Module,
    estimator: str = "softmax",
    *,
    cross_attention: bool = False,
    **options: Any,
) -> nn.Module:
    """A copy of ``model`` with every self-attention replaced by kernelized attention.

    The pretrained projection weights are carried over; ``model`` itself is untouched.
    Each converted layer gets its own estimator built with
    ``create(estimator, **options)``, plus ``head_dim`` and ``num_heads`` when the
    estimator (or feature map) takes them. With ``seed=s`` layer ``i`` gets seed
    ``s + i`` (independent draws per layer, reproducible); without it the draws come
    from the global torch generator (``torch.manual_seed`` makes them reproducible).

    Parameters
    ----------
    model : nn.Module
        Any module holding :class:`torch.nn.MultiheadAttention` modules (for example an
        :class:`torch.nn.TransformerEncoder`), a Hugging Face BERT-family model, or a
        Hugging Face decoder (GPT-2, Llama, Mistral, Qwen2: any ``transformers`` model
        whose attention dispatches through its attention interface). A decoder is
        converted through ``transformers``' extension points
        (:mod:`kernelattn_core.convert.decoder`): its attention modules keep their class
        (a subclass is swapped in) and their weights, get an ``estimator``, and the model
        runs with ``attn_implementation="kernelattn"``; ``config.kernelattn`` records the
        estimator and options for :func:`from_pretrained`.
    estimator : str
        Registry name of an estimator, feature map or kernel (``"softmax"``: exact,
        the same function as the original).
    cross_attention : bool
        Also convert the cross-attention ``multihead_attn`` of
        :class:`torch.nn.TransformerDecoderLayer` (off by default: only self-attention).
    **options
        Estimator options (``num_features``, ``window``, ``seed``, ...).

    Returns
    -------
    nn.Module
        The converted copy, in the training mode of ``model``. The fused fast path of
        :class:`torch.nn.TransformerEncoder` is switched off on it
        (``use_nested_tensor = False``).

    Raises
    ------
    InputError
        When ``model`` holds no attention module this function knows.

    Examples
    --------
    >>> import torch, kernelattn_core as ka
    >>> from kernelattn_core.convert import convert_attention
    >>> layer = torch.nn.TransformerEncoderLayer(32, 4, batch_first=True)
    >>> encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    >>> fast = convert_attention(encoder, "elu")
    >>> type(fast.layers[0].self_attn).__name__
    'KernelAttention'
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    check_bool("cross_attention", cross_attention)
    _check_options(estimator, options)
    out = copy.deepcopy(model)
    targets: list[tuple[str, nn.Module]] = []
    converted = 0
    for name, module in out.named_modules():
        if isinstance(module, _CONVERTED):
            converted += 1
            continue
        if isinstance(module, nn.MultiheadAttention):
            if not cross_attention and name.split(".")[-1] == "multihead_attn":
                continue
            targets.append((name, module))
        elif is_hf_self_attention(name, module) or is_hf_decoder_attention(name, module):
            targets.append((name, module))
    if not targets and converted:
        raise InputError(
            f"model: every attention of this {type(model).__name__} is converted already ({converted} layers); "
            "convert the original model again with another estimator"
        )
    if not targets:
        raise InputError(
            f"model: no self-attention to convert in {type(model).__name__} (expected torch.nn.MultiheadAttention, "
            "a Hugging Face BERT/RoBERTa/DistilBERT self-attention or a Hugging Face decoder attention that "
            "dispatches through transformers' attention interface)"
        )
    for name, module in targets:
        _refuse_meta(name, module)
    decoders = False
    for index, (name, module) in enumerate(targets):
        _check_head_dim(name, module, options)
        layer_options = dict(options)
        if layer_options.get("seed") is not None:
            layer_options["seed"] = layer_options["seed"] + index
        if isinstance(module, nn.MultiheadAttention):
            new: nn.Module = KernelAttention.from_multihead(module, estimator, **layer_options)
        elif is_hf_self_attention(name, module):
            new = HFKernelSelfAttention.from_module(module, estimator, **layer_options)
        else:
            new = convert_decoder_module(module, estimator, **layer_options)  # in place, in the copy
            decoders = True
        parent_name, _, attr = name.rpartition(".")
        setattr(out.get_submodule(parent_name), attr, new)
    for module in out.modules():
        if isinstance(module, nn.TransformerEncoder):
            module.use_nested_tensor = False
    if decoders:
        finish_conversion(out, estimator, options)
    return out


#: options the converted module sets from the original one (an estimator option of the
#: same name would contradict it)
_SET_BY_MODULE = ("num_heads", "embed_dim", "kdim", "vdim", "batch_first", "bias", "device", "dtype")


def _check_options(estimator: object, options: dict[str, Any]) -> None:
    """Refuse, before any work, what the conversion would fail on later or read wrongly."""
    if not isinstance(estimator, str) or not estimator:
        raise InputError(f"estimator: expected a registry name (str), got {estimator!r}")
    resolve(estimator)  # an unknown name is refused here, listing the known ones
    for key in _SET_BY_MODULE:
        if key in options:
            raise InputError(
                f"{key}: set by each converted module from the original attention (its width, heads, layout, "
                f"dtype and device), not an estimator option; got {key}={options[key]!r}"
            )
    check_seed("seed", options.get("seed"))  # "abc" is no seed, and 1.5 is not truncated to 1
    if "causal" in options:
        check_bool("causal", options["causal"])
    if "head_dim" in options:
        check_positive_int("head_dim", options["head_dim"])


def _refuse_meta(name: str, module: nn.Module) -> None:
    """Refuse an attention module whose parameters or buffers are on the meta device: the
    estimator would be built there, and its random draws and learned parameters are not in
    the original's state dict, so ``to_empty()`` then ``load_state_dict(strict=False)``
    leave them uninitialised memory (NaN logits, or wrong ones with no error)."""
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        raise InputError(
            f"model: the parameters of {type(module).__name__} ({name!r}) are on the meta device (a skeleton built "
            "under torch.device('meta') or init_empty_weights, or weights offloaded by a device_map); the "
            "estimator's draws and parameters would be made there and no weight loading initialises them: convert "
            "after loading the real weights (expected parameters on a real device, got meta)"
        )


def _check_head_dim(name: str, module: nn.Module, options: dict[str, Any]) -> None:
    """A ``head_dim`` option must be the module's own (``embed_dim / num_heads``): another
    one would only fail at the first forward call."""
    if "head_dim" not in options:
        return
    if isinstance(module, nn.MultiheadAttention):
        actual = module.head_dim
    elif is_hf_decoder_attention(name, module):
        actual = decoder_shape(module)[0]
    else:
        actual = module.query.out_features if hasattr(module, "query") else module.q_lin.out_features
        actual //= _hf_heads(module)
    if options["head_dim"] != actual:
        raise InputError(
            f"head_dim: the attention {name!r} has heads of width {actual}, got head_dim={options['head_dim']} "
            "(leave it out: each converted module sets its own)"
        )


def converted_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The kernelized attention modules of ``model`` with their names, in order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _CONVERTED)]


# ---------------------------------------------------------------------- loading
def from_pretrained(path: str | Path, *, model_class: Any = None, **kwargs: Any) -> nn.Module:
    """Load a converted decoder saved with ``save_pretrained``: the model with its
    pretrained weights, converted again as its ``config.kernelattn`` records, and every
    estimator's parameters and draws from the saved weights.

    Parameters
    ----------
    path : str or Path
        The folder ``save_pretrained`` wrote.
    model_class : type, optional
        The ``transformers`` class to load (default: the config's first architecture,
        for example ``GPT2LMHeadModel``).
    **kwargs
        Passed to ``model_class.from_pretrained`` (``dtype``, ``device_map``, ...).

    Raises
    ------
    InputError
        When the folder holds no converted model, its record cannot be rebuilt (options
        that are not JSON), or the saved estimator weights do not match the rebuilt
        estimators (each missing or unexpected key is named).
    """
    import transformers

    register()
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise InputError(f"path: expected a folder written by save_pretrained (with config.json), got {str(path)!r}")
    data = json.loads(config_file.read_text("utf-8"))
    record = data.get(RECORD)
    if not isinstance(record, dict) or "estimator" not in record:
        raise InputError(
            f"path: {str(path)!r} holds no kernelattn conversion (config.json has no {RECORD!r} record); load it "
            "with transformers and convert it with convert_attention"
        )
    if not record.get("portable", True):
        raise InputError(
            f"path: the conversion in {str(path)!r} used options that are not JSON ({record['options']}); "
            "convert the base model again with the same objects and load the state dict"
        )
    if model_class is None:
        arch = (data.get("architectures") or [None])[0]
        model_class = getattr(transformers, arch, None) if isinstance(arch, str) else None
        if model_class is None:
            raise InputError(f"model_class: config.json names no transformers architecture ({arch!r}); pass one")
    kwargs.setdefault("attn_implementation", "sdpa")
    logger = transformers.utils.logging.get_logger("transformers.modeling_utils")
    level = logger.level
    logger.setLevel(40)  # the estimator keys are reported as unexpected here; they are loaded and checked below
    from ..workloads.minilm import loading_quietly

    try:
        with loading_quietly():
            base, info = model_class.from_pretrained(str(folder), output_loading_info=True, **kwargs)
    finally:
        logger.setLevel(level)
    model = convert_attention(base, record["estimator"], **record["options"])
    saved = _saved_state(folder)
    wanted = {k for k in model.state_dict() if ".estimator." in f".{k}"}
    have = {k for k in saved if ".estimator." in f".{k}"}
    missing, unexpected = sorted(wanted - have), sorted(have - wanted)
    if missing or unexpected:
        raise InputError(
            f"path: the saved estimator weights do not match the rebuilt estimators: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    others = [k for k in info.get("unexpected_keys", []) if ".estimator." not in f".{k}"]
    if info.get("missing_keys") or others:
        raise InputError(
            f"path: the saved model does not match {model_class.__name__}: missing {sorted(info['missing_keys'])[:5]}, "
            f"unexpected {others[:5]}"
        )
    device = next(iter(model.parameters())).device
    result = model.load_state_dict({k: saved[k].to(device) for k in have}, strict=False)
    assert not result.unexpected_keys  # checked above
    return model.eval()


def _saved_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors (or ``pytorch_model.bin``) files in ``folder``."""
    files = sorted(folder.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            out.update(load_file(str(f)))
        return out
    for f in sorted(folder.glob("pytorch_model*.bin")):
        out.update(torch.load(f, map_location="cpu", weights_only=True))
    if not out:
        raise InputError(f"path: no weights (*.safetensors or pytorch_model*.bin) in {str(folder)!r}")
    return out
