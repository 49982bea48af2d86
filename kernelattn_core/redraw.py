"""The redraw policy shared by every random feature map.

* ``every = k > 0``: a fresh draw every ``k`` training forward calls (the first call
  uses the initial draw); ``every = 0``: never redraw after the first draw.
* Evaluation mode (``module.eval()``) never redraws: outputs are frozen.
* Draw number ``r`` uses a CPU :class:`torch.Generator` seeded with a fixed function
  of ``(seed, r)``. Replicas of a data-parallel model that share the seed and the
  step therefore draw the same features, on every device, without communication.
* ``seed``, the step counter and the draw counter are buffers, so ``state_dict``
  carries them with the draws: a reloaded model gives bit-identical outputs and
  continues the same schedule.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import InputError
from .interfaces.feature_map import FeatureMap
from .validation import check_positive_int

_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def generator_for(seed: int, draw: int) -> torch.Generator:
    """The CPU generator of draw number ``draw`` under ``seed``."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed + _GOLDEN * (draw + 1)) & _MASK63)
    return g


class RedrawPolicy(nn.Module):
    """When and how a feature map gets new random draws.

    Parameters
    ----------
    every : int
        Redraw every ``every`` training steps; 0 never redraws.
    seed : int, optional
        Base seed; when ``None`` one is taken from the global torch generator, so
        ``torch.manual_seed`` makes the whole model reproducible.
    """

    def __init__(self, every: int = 0, seed: int | None = None) -> None:
        super().__init__()
        self.every = check_positive_int("redraw_every", every, minimum=0)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), dtype=torch.long))
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InputError(f"seed: expected an int or None, got {seed!r}")
        self.register_buffer("seed", torch.tensor(seed & _MASK63, dtype=torch.long))
        self.register_buffer("step", torch.tensor(0, dtype=torch.long))
        self.register_buffer("draws", torch.tensor(0, dtype=torch.long))

    def generator(self) -> torch.Generator:
        """Generator of the current draw number."""
        return generator_for(int(self.seed), int(self.draws))

    def initial(self, feature_map: FeatureMap, head_dim: int) -> None:
        """Build ``feature_map`` for ``head_dim`` with draw number 0."""
        feature_map.build(head_dim, generator=self.generator())

    def before_forward(self, feature_map: FeatureMap, training: bool) -> None:
        """Advance the schedule by one forward call and redraw when it is due."""
        if not training or self.every == 0 or not feature_map.random:
            return
        step = int(self.step)
        if step > 0 and step % self.every == 0:
            self.draws += 1
            feature_map.redraw(generator=self.generator())
        self.step += 1

    def extra_repr(self) -> str:
        return f"every={self.every}, seed={int(self.seed)}"
