"""The redraw policy shared by every random feature map.

* ``every = k > 0``: a fresh draw every ``k`` training forward calls (the first call
  uses the initial draw); ``every = 0``: never redraw after the first draw. A training
  forward call is any call in training mode (``module.train()``), under
  ``torch.no_grad()`` too (a validation pass without ``eval()`` counts), except the
  recompute of an activation checkpoint (:func:`recomputing`).
* Evaluation mode (``module.eval()``) never redraws: outputs are frozen.
* A forward call that runs inside a backward pass (the recompute of
  :func:`torch.utils.checkpoint.checkpoint`, reentrant or not) advances nothing and draws
  nothing: it uses the draws of the last training forward call, so the gradients are
  those of the forward pass that made the output.
* Draw number ``r`` uses a CPU :class:`torch.Generator` seeded with a fixed function
  of ``(seed, r)``. Replicas of a data-parallel model that share the seed and the
  step therefore draw the same features, on every device, without communication.
* ``seed=None`` takes a seed from the global torch generator; inside an initialised
  :mod:`torch.distributed` process group the seed is *agreed*: rank 0's is broadcast
  once (:func:`agreed_seed`), when the policy is made or, if the group is initialised
  later (a model built before ``init_process_group``), at the first training forward
  call after that (:meth:`RedrawPolicy.agree`), which also redraws the current draw with
  the agreed seed. Every rank therefore holds the same draws, shapes included, from the
  first training step on, even with ``broadcast_buffers=False`` and no seed given.
* ``seed``, the step counter and the draw counter are buffers, so ``state_dict``
  carries them with the draws: a reloaded model gives bit-identical outputs and
  continues the same schedule.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .interfaces.feature_map import FeatureMap
from .validation import check_positive_int
from .validation import check_seed as _check_seed

_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def generator_for(seed: int, draw: int) -> torch.Generator:
    """The CPU generator of draw number ``draw`` under ``seed``."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed + _GOLDEN * (draw + 1)) & _MASK63)
    return g


def _group_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def recomputing() -> bool:
    """Whether the current forward call runs inside a backward pass: the recompute of an
    activation checkpoint (:func:`torch.utils.checkpoint.checkpoint`, ``use_reentrant``
    ``True`` or ``False``).

    Such a call must replay the forward pass whose output is being differentiated: it
    advances no redraw schedule, sample counter or running statistic and uses the draws
    of the last training forward call. ``False`` while Dynamo traces (a compiled graph
    has no checkpoint recompute of its own to detect, and reading the autograd engine's
    state would break the graph) and, as before this check existed, on a torch without
    ``torch._C._current_graph_task_id``.
    """
    if torch.compiler.is_compiling():
        return False
    current = getattr(torch._C, "_current_graph_task_id", None)
    if current is None:  # pragma: no cover - a torch without the hook: every forward counts
        return False
    try:
        return current() != -1
    except Exception:  # pragma: no cover - defensive: never fail a forward call over this
        return False


def check_seed(seed: object) -> int | None:
    """Check a ``seed`` option: an int or ``None`` (:func:`~kernelattn_core.validation.check_seed`)."""
    return _check_seed("seed", seed)


def agreed_seed(seed: int | None = None) -> int:
    """``seed``, or when ``None`` a fresh seed that every rank of an initialised process
    group shares.

    Outside a process group the fresh seed comes from the global torch generator (so
    ``torch.manual_seed`` makes a model reproducible). Inside one, rank 0's draw is
    broadcast, a collective: every rank must call this at the same point (building a
    model does). Random estimators of plugins should take their seed from here.
    """
    seed = check_seed(seed)
    if seed is not None:
        return seed & _MASK63
    local = int(torch.randint(0, 2**62, (), dtype=torch.long))
    if not _group_ready():
        return local
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([local], dtype=torch.long, device=device)
    dist.broadcast(t, src=0)
    return int(t.item()) & _MASK63


class RedrawPolicy(nn.Module):
    """When and how a feature map gets new random draws.

    Parameters
    ----------
    every : int
        Redraw every ``every`` training forward calls (calls in training mode, under
        ``torch.no_grad()`` too; not checkpoint recomputes); 0 never redraws.
    seed : int, optional
        Base seed; when ``None`` one is taken from the global torch generator, so
        ``torch.manual_seed`` makes the whole model reproducible, and agreed across the
        ranks of an initialised process group (:func:`agreed_seed`).
    """

    def __init__(self, every: int = 0, seed: int | None = None) -> None:
        super().__init__()
        self.every = check_positive_int("redraw_every", every, minimum=0)
        seed = check_seed(seed)
        #: whether the seed is the user's or already agreed across ranks (not a buffer:
        #: a loaded state dict brings its seed, and loading is the same on every rank)
        self._seed_settled = seed is not None or _group_ready()
        self.register_buffer("seed", torch.tensor(agreed_seed(seed), dtype=torch.long))
        self.register_buffer("step", torch.tensor(0, dtype=torch.long))
        self.register_buffer("draws", torch.tensor(0, dtype=torch.long))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "seed" in state_dict:  # a loaded seed is the same on every rank that loads it
            self._seed_settled = True

    def generator(self) -> torch.Generator:
        """Generator of the current draw number."""
        return generator_for(int(self.seed), int(self.draws))

    def _settle_seed(self) -> bool:
        """Agree the seed across ranks if it was drawn before the process group existed
        (one collective, once); whether the seed changed."""
        changed = False
        if not self._seed_settled and _group_ready():
            agreed = agreed_seed(None)
            changed = agreed != int(self.seed)
            self.seed.fill_(agreed)
        self._seed_settled = self._seed_settled or _group_ready()
        return changed

    def agree(self, feature_map: FeatureMap | None = None) -> bool:
        """At a training forward call: agree a seed that was taken before the process
        group existed, and redraw ``feature_map``'s current draw with it.

        A model built before ``torch.distributed.init_process_group`` made its draw 0
        (and any draw since) from a seed of its own rank. The first training forward
        call after the group exists agrees the seed (rank 0's, one broadcast, on every
        rank at the same call, as a DDP step is) and, when it differs from the one the
        draw used, redraws the same draw number with it, so every rank holds the same
        features from that step on. Nothing happens (no collective) for a user seed, a
        seed already agreed or loaded, outside a process group, in a checkpoint
        recompute or while Dynamo traces. Returns whether the seed changed.
        """
        if self._seed_settled or torch.compiler.is_compiling() or not _group_ready() or recomputing():
            return False
        changed = self._settle_seed()
        if changed and feature_map is not None and feature_map.random and feature_map.built:
            feature_map.redraw(generator=self.generator())
        return changed

    def initial(self, feature_map: FeatureMap, head_dim: int) -> None:
        """Build ``feature_map`` for ``head_dim`` with draw number 0."""
        self._settle_seed()
        feature_map.build(head_dim, generator=self.generator())

    def before_forward(self, feature_map: FeatureMap, training: bool) -> None:
        """At a training forward call: agree a seed taken before the process group existed
        (:meth:`agree`), then advance the schedule by one call and redraw when it is due.

        A checkpoint recompute (:func:`recomputing`) advances nothing: the map keeps the
        draw the forward pass it replays used."""
        if not training or recomputing():
            return
        self.agree(feature_map)
        if self.every == 0 or not feature_map.random:
            return
        step = int(self.step)
        if step > 0 and step % self.every == 0:
            self._settle_seed()
            self.draws += 1
            feature_map.redraw(generator=self.generator())
        self.step += 1

    def extra_repr(self) -> str:
        return f"every={self.every}, seed={int(self.seed)}"
