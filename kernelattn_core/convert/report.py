"""Judge a converted model where the approximation matters: embeddings by length.

A sliding window of ``w`` keys on each side plus a global ``[CLS]`` computes every
sentence of at most ``w + 1`` tokens *exactly*, so sentence-level figures mostly show
exact computation. :func:`embedding_report` therefore compares the sentence embeddings
(mean pooling of the last hidden state) of the converted model and the original on a
pool of texts of every length taken from one evaluation text:

* its sentences (natural lengths, padded in batches, so the masks are exercised);
* packed pieces of the token stream of 64, 128, 256 and 512 tokens (``[CLS] ... [SEP]``,
  non-overlapping, cut mid-sentence as a long document is).

and reports

* the cosine :math:`\\cos(e_i, \\hat e_i)` by length bucket (``<=25``, ``26-127``,
  ``128-511``, ``512`` tokens, special tokens included): count, mean and minimum;
* the same on the packed passages of 128 and 512 tokens (the *headline*: the mean cosine
  of the 512-token passages, the length a linear-time estimator exists for);
* nearest-neighbour agreement@1 over the sentences: the fraction of sentences whose
  nearest other sentence (cosine) is the same under both models;
* the Spearman rank correlation of the two sentence similarity matrices (upper
  triangle), and the nearest-neighbour agreement over the 128-token passages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InputError

#: length buckets (tokens, special tokens included): name, smallest, largest
BUCKETS: tuple[tuple[str, int, int], ...] = (
    ("<=25", 1, 25),
    ("26-127", 26, 127),
    ("128-511", 128, 511),
    ("512", 512, 512),
)

#: lengths of the packed pieces
PIECES: tuple[int, ...] = (64, 128, 256, 512)

#: lengths of the reported passages
PASSAGES: tuple[int, ...] = (128, 512)


@dataclass
class EmbeddingReport:
    """Embedding figures of a converted model against the original on one text.

    Attributes
    ----------
    text : str
        Name of the evaluation text.
    buckets : list of dict
        ``{"bucket", "count", "mean", "min"}`` per length bucket (``count`` 0: no text
        of that length; ``mean``/``min`` then NaN).
    passages : dict
        ``{"128": {"count", "mean", "min"}, "512": {...}}``.
    nn_agreement : float
        Nearest-neighbour agreement@1 over the sentences.
    spearman : float
        Spearman correlation of the sentence similarity matrices.
    passage_nn_agreement : float
        Nearest-neighbour agreement@1 over the 128-token passages (NaN with fewer than 3).
    sentences : int
    sentence_mean : float
        Mean cosine over the sentences alone (the ``embedding_cosine`` of earlier versions).
    seconds : float
    """

    text: str
    buckets: list[dict[str, Any]] = field(default_factory=list)
    passages: dict[str, dict[str, Any]] = field(default_factory=dict)
    nn_agreement: float = math.nan
    spearman: float = math.nan
    passage_nn_agreement: float = math.nan
    sentences: int = 0
    sentence_mean: float = math.nan
    seconds: float = 0.0

    @property
    def headline(self) -> float:
        """Mean cosine of the 512-token passages (the longest available when the text or
        the model is shorter)."""
        for length in sorted(self.passages, key=int, reverse=True):
            if self.passages[length]["count"]:
                return float(self.passages[length]["mean"])
        return math.nan

    def flat(self) -> dict[str, Any]:
        """One flat record (JSON and tables): ``cos_<bucket>_mean/min/count``,
        ``passage<N>_mean/min/count``, ``nn_agreement``, ``spearman``,
        ``passage_nn_agreement``, ``headline``."""
        out: dict[str, Any] = {"text": self.text}
        for b in self.buckets:
            key = "cos_" + b["bucket"].replace("<=", "le").replace("-", "_")
            out[f"{key}_mean"], out[f"{key}_min"], out[f"{key}_count"] = b["mean"], b["min"], b["count"]
        for length, p in self.passages.items():
            out[f"passage{length}_mean"], out[f"passage{length}_min"] = p["mean"], p["min"]
            out[f"passage{length}_count"] = p["count"]
        out.update(
            nn_agreement=self.nn_agreement,
            spearman=self.spearman,
            passage_nn_agreement=self.passage_nn_agreement,
            sentences=self.sentences,
            sentence_mean=self.sentence_mean,
            headline=self.headline,
        )
        return out


def _stats(values: torch.Tensor) -> dict[str, Any]:
    if values.numel() == 0:
        return {"count": 0, "mean": math.nan, "min": math.nan}
    return {"count": int(values.numel()), "mean": float(values.mean()), "min": float(values.min())}


def nn_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of rows whose nearest other row (cosine) is the same in ``a`` and ``b``
    (``[n, E]`` each, ``n >= 2``)."""
    if a.shape[0] < 2:
        return math.nan

    def nearest(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.normalize(x.double(), dim=-1)
        sims = x @ x.T
        sims.fill_diagonal_(-math.inf)
        return sims.argmax(-1)

    return float((nearest(a) == nearest(b)).double().mean())


def _ranks(x: torch.Tensor) -> torch.Tensor:
    order = x.argsort()
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(x.numel(), dtype=x.dtype, device=x.device)
    return ranks


def spearman_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of the cosine similarity matrices of ``a`` and ``b``
    over pairs ``i < j`` (ties broken by position)."""
    n = a.shape[0]
    if n < 3:
        return math.nan
    iu = torch.triu_indices(n, n, 1)

    def sims(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.normalize(x.double(), dim=-1)
        return (x @ x.T)[iu[0], iu[1]]

    ra, rb = _ranks(sims(a)), _ranks(sims(b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-300))


def pieces(tokenizer: Any, text: str, length: int, *, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping packed pieces ``[P, length]`` of the token stream of ``text``, each
    ``[CLS] ... [SEP]`` (no padding; a text shorter than one piece gives none)."""
    if length < 3:
        raise InputError(f"length: expected at least 3 tokens (CLS, one token, SEP), got {length}")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    step = length - 2
    rows = [
        [tokenizer.cls_token_id, *ids[i : i + step], tokenizer.sep_token_id]
        for i in range(0, len(ids) - step + 1, step)
    ]
    if limit is not None:
        rows = rows[:limit]
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), length)


@torch.no_grad()
def _embed_ids(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, batch_size: int) -> torch.Tensor:
    from ..workloads.minilm import mean_pool

    device = next(model.parameters()).device
    out = []
    for start in range(0, ids.shape[0], batch_size):
        i, m = ids[start : start + batch_size].to(device), mask[start : start + batch_size].to(device)
        out.append(mean_pool(model(input_ids=i, attention_mask=m).last_hidden_state, m).double().cpu())
    return torch.cat(out) if out else torch.zeros(0, 0, dtype=torch.float64)


@torch.no_grad()
def embedding_report(
    reference: torch.nn.Module,
    other: torch.nn.Module,
    tokenizer: Any,
    text: str,
    *,
    name: str = "text",
    max_sentences: int = 256,
    max_pieces: int = 16,
    max_length: int | None = None,
    batch_size: int = 16,
) -> EmbeddingReport:
    """Compare the embeddings of ``other`` (the converted model) with ``reference``'s on
    the sentences and packed pieces of ``text`` (see the module docstring).

    Parameters
    ----------
    reference, other : nn.Module
        Hugging Face encoders returning ``last_hidden_state`` (both in eval mode).
    tokenizer
        The models' tokenizer.
    text : str
        The evaluation text (never the fitting text).
    name : str
        Label of the text in the report.
    max_sentences : int
        The first this many sentences (of four words or more) are embedded.
    max_pieces : int
        At most this many pieces of each length (:data:`PIECES`).
    max_length : int, optional
        Longest piece and sentence; default: the model's positions
        (``config.max_position_embeddings``), at most 512.
    batch_size : int

    Returns
    -------
    EmbeddingReport
    """
    import time

    from ..workloads import minilm

    t0 = time.perf_counter()
    if max_length is None:
        positions = getattr(getattr(reference, "config", None), "max_position_embeddings", None)
        max_length = min(512, positions) if isinstance(positions, int) else 512
    found = minilm.sentences(text)[:max_sentences]
    if not found:
        raise InputError(f"texts: {name!r} holds no sentence of four words or more to embed")
    lengths, cosines = [], []
    sentence_pairs: list[torch.Tensor] = []
    for chunk in minilm.batched(found, batch_size):
        enc = tokenizer(list(chunk), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        a = _embed_ids(reference, enc["input_ids"], enc["attention_mask"], batch_size)
        b = _embed_ids(other, enc["input_ids"], enc["attention_mask"], batch_size)
        sentence_pairs.append(torch.stack([a, b]))
        lengths.append(enc["attention_mask"].sum(-1))
        cosines.append(torch.nn.functional.cosine_similarity(a, b, dim=-1))
    sent = torch.cat(sentence_pairs, dim=1)  # [2, S, E]
    sentence_mean = float(torch.cat(cosines).mean())
    passage_cos: dict[int, torch.Tensor] = {}
    passage_emb: dict[int, torch.Tensor] = {}
    for length in PIECES:
        if length > max_length:
            continue
        ids = pieces(tokenizer, text, length, limit=max_pieces)
        if ids.shape[0] == 0:
            passage_cos[length] = torch.zeros(0, dtype=torch.float64)
            continue
        mask = torch.ones_like(ids)
        a = _embed_ids(reference, ids, mask, batch_size)
        b = _embed_ids(other, ids, mask, batch_size)
        passage_cos[length] = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        passage_emb[length] = torch.stack([a, b])
        lengths.append(torch.full((ids.shape[0],), length))
        cosines.append(passage_cos[length])
    all_len, all_cos = torch.cat(lengths), torch.cat(cosines)
    report = EmbeddingReport(text=name, sentences=len(found), sentence_mean=sentence_mean)
    for bucket, lo, hi in BUCKETS:
        stats = _stats(all_cos[(all_len >= lo) & (all_len <= hi)])
        report.buckets.append({"bucket": bucket, **stats})
    for length in PASSAGES:
        report.passages[str(length)] = _stats(passage_cos.get(length, torch.zeros(0, dtype=torch.float64)))
    report.nn_agreement = nn_agreement(sent[0], sent[1])
    report.spearman = spearman_similarity(sent[0], sent[1])
    if 128 in passage_emb and passage_emb[128].shape[1] >= 3:
        report.passage_nn_agreement = nn_agreement(passage_emb[128][0], passage_emb[128][1])
    report.seconds = time.perf_counter() - t0
    return report


def embedding_reports(
    reference: torch.nn.Module,
    other: torch.nn.Module,
    tokenizer: Any,
    texts: dict[str, str] | Sequence[str],
    **options: Any,
) -> list[EmbeddingReport]:
    """:func:`embedding_report` for each text (a dict ``name -> text`` or a sequence of
    names of :func:`kernelattn_core.workloads.minilm.read_texts`)."""
    from ..workloads import minilm

    named = dict(texts) if isinstance(texts, dict) else {str(t): minilm.read_texts(t) for t in texts}
    was = reference.training, other.training
    reference.eval()
    other.eval()
    try:
        return [embedding_report(reference, other, tokenizer, body, name=n, **options) for n, body in named.items()]
    finally:
        reference.train(was[0])
        other.train(was[1])
