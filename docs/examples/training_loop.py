"""A small causal transformer language model with :class:`kernelattn_core.KernelAttention`.

Trains on a synthetic copy task with padded batches, bf16 autocast and (optionally)
``torch.compile``, then decodes greedily with the estimator's ``step`` (running sums,
constant memory per token). Run ``python docs/examples/training_loop.py --help``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import kernelattn_core as ka


class Block(nn.Module):
    """Pre-norm transformer block whose attention is any kernelattn estimator."""

    def __init__(self, width: int, heads: int, estimator: str, **options: object) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = ka.KernelAttention(width, heads, estimator, causal=True, batch_first=True, **options)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        h, _ = self.attn(self.norm1(x), key_padding_mask=key_padding_mask)  # [B, N, width]
        x = x + h
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token and position embeddings, ``depth`` blocks, a tied output layer."""

    def __init__(self, vocab: int, width: int = 64, heads: int = 4, depth: int = 2, max_len: int = 256,
                 estimator: str = "prf", **options: object) -> None:  # fmt: skip
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, width), nn.Embedding(max_len, width)
        # small embeddings (GPT-2's 0.02): the output layer is tied to them, and unit-variance
        # rows give logits of size sqrt(width), a first loss of ~40 and a model that settles
        # on predicting one token
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(width, heads, estimator, **options) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, N, vocab]`` of the next token at every position."""
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x, key_padding_mask)
        return self.norm(x) @ self.embed.weight.T


def copy_batch(batch: int, length: int, vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences ``a b c ... | a b c ...`` of random lengths, right-padded (mask ``True`` = padding)."""
    half = length // 2
    tokens = torch.zeros(batch, length, dtype=torch.long)
    mask = torch.ones(batch, length, dtype=torch.bool)
    for i in range(batch):
        n = int(torch.randint(half // 2, half + 1, (), generator=generator))
        seq = torch.randint(1, vocab, (n,), generator=generator)
        tokens[i, : 2 * n] = torch.cat([seq, seq])
        mask[i, : 2 * n] = False
    return tokens, mask


def train(steps: int = 200, *, estimator: str = "prf", compile_backend: str | None = None, seed: int = 0,
          log_every: int = 50, **options: object) -> tuple[TinyLM, list[float]]:  # fmt: skip
    """Train :class:`TinyLM` on the copy task; returns the model and the loss of every step."""
    torch.manual_seed(seed)
    vocab, length = 16, 32
    model = TinyLM(vocab, estimator=estimator, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step_fn = torch.compile(model, backend=compile_backend) if compile_backend else model
    g = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        tokens, mask = copy_batch(16, length, vocab, g)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # on GPU: torch.autocast("cuda", ...)
            logits = step_fn(tokens[:, :-1], key_padding_mask=mask[:, :-1])
        target = tokens[:, 1:].masked_fill(mask[:, 1:], -100)  # no loss on padding
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), target.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log_every and step % log_every == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}")
    return model, losses


@torch.no_grad()
def copy_accuracy(model: TinyLM, batch: int = 64, seed: int = 123) -> float:
    """Share of the second halves' tokens predicted right (the first halves are random: no
    model predicts them; chance is 1/15), on fresh sequences."""
    model.eval()
    tokens, mask = copy_batch(batch, 32, 16, torch.Generator().manual_seed(seed))
    logits = model(tokens[:, :-1], key_padding_mask=mask[:, :-1])
    hits = total = 0
    for i, n in enumerate(((~mask).sum(1) // 2).tolist()):  # row i: a b c ... | a b c ..., n tokens each
        hits += int((logits[i, n : 2 * n - 1].argmax(-1) == tokens[i, n + 1 : 2 * n]).sum())
        total += n - 1
    model.train()
    return hits / total


@torch.no_grad()
def generate(model: TinyLM, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding, one token at a time, through each layer's
    :meth:`~kernelattn_core.KernelAttention.step`: the estimator's running sums for
    feature-map estimators (constant memory and time per token), a key-value cache for the
    others (``softmax``)."""
    model.eval()
    states: list[object] = [None] * len(model.blocks)
    out = prompt.clone()

    def advance(tokens: torch.Tensor, start: int) -> torch.Tensor:
        pos = torch.arange(start, start + tokens.shape[1])
        x = model.embed(tokens) + model.pos(pos)
        for i, block in enumerate(model.blocks):
            h, states[i] = block.attn.step(block.norm1(x), states[i])  # [B, T, width]
            x = x + h
            x = x + block.mlp(block.norm2(x))
        return model.norm(x) @ model.embed.weight.T

    logits = advance(prompt, 0)  # the prompt in one call
    for _ in range(new_tokens):
        nxt = logits[:, -1:].argmax(-1)
        out = torch.cat([out, nxt], dim=1)
        logits = advance(nxt, out.shape[1] - 1)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--estimator", default="prf", help="a registry name (prf, elu, hedgehog, softmax, ...)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--num-features", type=int, help="the estimator's feature budget (its default if not given)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    args = parser.parse_args()
    options = {} if args.num_features is None else {"num_features": args.num_features}
    model, losses = train(args.steps, estimator=args.estimator, compile_backend="inductor" if args.compile else None,
                          **options)  # fmt: skip
    print(f"copy accuracy {copy_accuracy(model):.2f} (chance 0.07)")
    prompt = torch.tensor([[3, 7, 1, 12, 5, 9]])
    print("prompt", prompt.tolist(), "->", generate(model, prompt, 6).tolist())
