"""The redraw policy shared by every random feature map.

* ``every = k > 0``: a fresh draw every ``k`` training forward calls (the first call
  uses the initial draw); ``every = 0``: never redraw after the first draw. A training
  forward call is any call in training mode (``module.train()``), under
  ``torch.no_grad()`` too (a validation pass without ``eval()`` counts), except the
  recompute of an activation checkpoint (:func:`recomputing`).
* Evaluation mode (``module.eval()``) never redraws: outputs are frozen.
* A forward call that runs inside a backward pass (the recompute of
  :func:`torch.utils.checkpoint.checkpoint`, reentrant or not) advances nothing and draws
  nothing new: it uses the draws of the forward call it recomputes, so the gradients are
  those of the forward pass that made the output, also when the same layer ran several
  checkpointed calls before one backward pass (:class:`PendingDraws`). A recompute
  whose call cannot be identified while another pending call used other draws raises
  :class:`ReplayError` instead of guessing.
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

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import ReplayError
from .interfaces.feature_map import FeatureMap
from .validation import check_positive_int
from .validation import check_seed as _check_seed

_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15


#: why a compiled call stops at the redraw schedule (``torch.compile(fullgraph=True)`` shows it)
REDRAW_UNDER_COMPILE = (
    "kernelattn: redraw_every > 0 counts training calls and draws new random features on the host between "
    "calls, which one compiled graph cannot hold; with fullgraph=True use redraw_every=0 and call "
    "feature_map.redraw() outside the compiled function, or compile without fullgraph (one graph break per "
    "training call, a recompilation after each redraw)"
)


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


_MISSING: Any = object()

#: torch's checkpoint internals that identify one checkpointed call, looked up once
#: (``None`` when this torch lacks them: no call is identified, see :func:`checkpoint_token`)
_CKPT: dict[str, Any] = {}


def _ckpt_internals() -> dict[str, Any]:
    if not _CKPT:
        try:
            import torch.utils.checkpoint as ckpt

            _CKPT["frame"] = getattr(ckpt, "_CheckpointFrame", None)
            fn = getattr(ckpt, "CheckpointFunction", None)
            _CKPT["node"] = getattr(fn, "_backward_cls", None)
            _CKPT["forward"] = getattr(getattr(fn, "forward", None), "__code__", None)
            _CKPT["checkpoint"] = getattr(getattr(ckpt, "checkpoint", None), "__code__", None)
            hook = getattr(getattr(ckpt, "_checkpoint_hook", None), "__init__", None)
            consts = getattr(getattr(hook, "__code__", None), "co_consts", ())
            _CKPT["unpack"] = tuple(
                c for c in consts if getattr(c, "co_name", "") == "unpack_hook" and "frame" in c.co_freevars
            )
        except Exception:  # pragma: no cover - defensive: nothing is identified then
            _CKPT.update(frame=None, node=None, forward=None, checkpoint=None, unpack=())
    return _CKPT


def _top_saved_tensor_hooks() -> tuple[Any, Any] | None:
    """The innermost saved-tensor hooks in force, ``(pack, unpack)``, or ``None`` (none in
    force; also while Dynamo traces, and on a torch without the query)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None or torch.compiler.is_compiling():
        return None
    try:
        return top(True)
    except Exception:  # pragma: no cover - defensive: never fail a forward call over this
        return None


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are in force (a non-reentrant activation checkpoint's,
    :class:`torch.autograd.graph.save_on_cpu`). ``False`` while Dynamo traces and on a
    torch without the query. The grouped engine then holds no one-group local graph (its
    unpacking would re-run the checkpointed forward), and :func:`checkpoint_token` looks
    for the checkpoint they belong to."""
    return _top_saved_tensor_hooks() is not None


def _hook_frame(hooks: tuple[Any, Any], cell_name: str) -> object | None:
    """The checkpoint frame that the pack hook of ``hooks`` (the top ones) closes over:
    ``frame`` in a non-reentrant checkpoint's original forward, ``target_frame_ref`` in
    its recompute; ``None`` when they are no checkpoint's."""
    pack = hooks[0]
    pack = getattr(pack, "__wrapped__", pack)  # the recompute's hook is wrapped by dynamo.disable
    code, closure = getattr(pack, "__code__", None), getattr(pack, "__closure__", None)
    if code is None or not closure:
        return None
    cells = dict(zip(code.co_freevars, closure))
    if cell_name not in cells:
        return None
    obj = cells[cell_name].cell_contents
    if cell_name == "target_frame_ref":
        obj = obj() if isinstance(obj, weakref.ref) else None
    kind = _ckpt_internals()["frame"]
    return obj if kind is not None and isinstance(obj, kind) else None


def _stack_frame(recompute: bool) -> object | None:
    """The non-reentrant checkpoint frame found on the call stack when other saved-tensor
    hooks sit above the checkpoint's: the ``frame`` of the unpack hook that runs the
    recompute, or the one ``checkpoint()``'s generator made for the original forward."""
    internals = _ckpt_internals()
    kind, unpack, call = internals["frame"], internals["unpack"], internals["checkpoint"]
    f = sys._getframe(2)
    while f is not None:
        if recompute and f.f_code in unpack:
            obj = f.f_locals.get("frame")
            return obj if kind is not None and isinstance(obj, kind) else None
        if not recompute and f.f_code is call:
            gen = f.f_locals.get("gen")
            obj = getattr(getattr(gen, "gi_frame", None), "f_locals", {}).get("new_frame")
            return obj if kind is not None and isinstance(obj, kind) else None
        f = f.f_back
    return None


def _reentrant_contexts() -> list[object]:
    """The ``ctx`` of every reentrant checkpoint (``CheckpointFunction.forward``) on the
    call stack, innermost first."""
    code = _ckpt_internals()["forward"]
    found: list[object] = []
    if code is None:
        return found
    f = sys._getframe(2)
    while f is not None:
        if f.f_code is code:
            ctx = f.f_locals.get("ctx")
            if ctx is not None:
                found.append(ctx)
        f = f.f_back
    return found


def _reentrant_context() -> object | None:
    """The ``ctx`` of the *outermost* reentrant checkpoint on the call stack, if any.

    A reentrant checkpoint nested in another runs under the outer one's
    ``torch.no_grad()`` forward: its own ``ctx`` is freed at once (its output is no part
    of any graph), while the outer one's lives until the outer recompute, whose
    :func:`torch._C._current_autograd_node` is that same node. The inner levels are
    matched during that recompute (:meth:`PendingDraws.replay`)."""
    found = _reentrant_contexts()
    return found[-1] if found else None


def checkpoint_token() -> object | None:
    """The activation checkpoint the current forward call belongs to, or ``None``.

    The same object in a checkpointed call's original forward pass and in its recompute:
    the node of a reentrant checkpoint (``use_reentrant=True``), the frame of a
    non-reentrant one. It lives as long as that checkpoint's graph, so what is kept
    weakly by it (:class:`PendingDraws`) goes with the graph. Found from the top
    saved-tensor hooks, else from the call stack (further hooks such as
    :class:`torch.autograd.graph.save_on_cpu` above the checkpoint's; a reentrant
    checkpoint's forward; the outermost one when reentrant checkpoints are nested).
    ``None`` outside a checkpoint, while Dynamo traces and on a torch whose checkpoint
    internals differ. A recompute of a non-reentrant checkpoint nested in the recompute of
    another belongs to the outer one (its original call is not known); a reentrant one
    nested in a recompute is matched through the draws the outer recompute replayed
    (:meth:`PendingDraws.replay`).
    Outside a checkpoint a call with gradients on and no saved-tensor hooks costs one
    query of those hooks; a call under ``torch.no_grad()`` also walks up the call stack.
    """
    if torch.compiler.is_compiling():
        return None
    try:
        if recomputing():
            node_kind = _ckpt_internals()["node"]
            node = torch._C._current_autograd_node()
            if node_kind is not None and isinstance(node, node_kind):
                return node
            hooks = _top_saved_tensor_hooks()
            return (hooks and _hook_frame(hooks, "target_frame_ref")) or _stack_frame(recompute=True)
        hooks = _top_saved_tensor_hooks()  # queried once per call
        if hooks is not None:
            return _hook_frame(hooks, "frame") or _stack_frame(recompute=False)
        if not torch.is_grad_enabled():
            return _reentrant_context()
    except Exception:  # pragma: no cover - defensive: never fail a forward call over this
        return None
    return None


def same_draws(a: object, b: object) -> bool:
    """Whether two recorded draws (ints, tuples, tensors or dicts of tensors) are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_draws(a[n], b[n]) for n in a)
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (
            torch.is_tensor(a)
            and torch.is_tensor(b)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b.to(a.device)))
        )
    return a == b


def _graph_task() -> int:
    """The id of the backward pass (graph task) that runs now; -1 outside one."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else -1


class _Record:
    """The draws of the checkpointed calls of one checkpoint, in call order, and how far
    the recompute of the backward pass ``task`` has replayed them."""

    __slots__ = ("distinct", "draws", "next", "ref", "task")

    def __init__(self, ref: weakref.ref, draws: object) -> None:
        self.ref = ref
        self.draws = [draws]
        #: whether the calls drew differently (else every recompute takes the one draw)
        self.distinct = False
        self.task = -1
        self.next = 0


class PendingDraws:
    """The draws of checkpointed training calls whose recompute may still come.

    :meth:`add` keys a call's draws by its :func:`checkpoint_token`, held weakly: an entry
    disappears with its checkpoint's graph (after the backward pass, once nothing holds
    the output), so entries never accumulate across steps; a backward pass with
    ``retain_graph=True`` can recompute again. Several calls inside one checkpoint (a
    weight-tied layer applied twice, ``checkpoint_sequential`` over a block that repeats
    a layer) are kept in call order, and the recompute, which runs the same calls in the
    same order, takes them one after the other; the count starts again in every backward
    pass (a second one with ``retain_graph=True``, and after a non-reentrant recompute that
    stopped early). Not copied by :func:`copy.deepcopy` nor pickled (a copy starts empty).
    """

    def __init__(self) -> None:
        self._items: dict[int, _Record] = {}

    def add(self, token: object, draws: object) -> None:
        key, items = id(token), self._items
        entry = items.get(key)
        if entry is not None and entry.ref() is token:  # another call inside the same checkpoint
            entry.distinct = entry.distinct or not same_draws(draws, entry.draws[0])
            entry.draws.append(draws)
            return

        def drop(ref: weakref.ref, key: int = key, items: dict = items) -> None:
            entry = items.get(key)
            if entry is not None and entry.ref is ref:
                del items[key]

        items[key] = _Record(weakref.ref(token, drop), draws)

    def _entry(self, token: object | None) -> _Record | None:
        if token is None:
            return None
        entry = self._items.get(id(token))
        return entry if entry is not None and entry.ref() is token else None

    def get(self, token: object | None, what: str = "a random layer") -> object:
        """The draws the next recomputed call of ``token``'s checkpoint must use (the
        calls' draws in call order, counted per backward pass), or the module constant
        ``_MISSING``. A recompute that replays more calls than were recorded while they
        drew differently raises :class:`ReplayError` naming ``what``."""
        entry = self._entry(token)
        if entry is None:
            return _MISSING
        if not entry.distinct:
            return entry.draws[-1]
        task = _graph_task()
        if entry.task != task:
            entry.task, entry.next = task, 0
        if entry.next >= len(entry.draws):
            raise ReplayError(
                f"{what}: one layer was called {len(entry.draws)} times with different random draws "
                "inside one activation checkpoint, and its recompute ran more calls of the layer than "
                "that checkpoint's forward pass did, so the calls cannot be matched to their draws "
                "(the recompute runs other calls than the forward pass: control flow that depends on "
                "the data or on state). Make the draws fixed (redraw_every=0, an eval-mode layer) or "
                "checkpoint each call of the layer separately."
            )
        entry.next += 1
        return entry.draws[entry.next - 1]

    def values(self) -> list[object]:
        return [v for entry in list(self._items.values()) if entry.ref() is not None for v in entry.draws]

    def __len__(self) -> int:
        return len(self.values())

    def __deepcopy__(self, memo: dict) -> PendingDraws:
        return PendingDraws()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._items = {}

    def replay(self, latest: object, what: str) -> object:
        """The draws the current recompute must use: those recorded for its checkpoint
        (call by call, in call order), else ``latest`` (the last training call's), unless
        another pending call used different draws, which raises :class:`ReplayError`
        naming ``what``.

        A reentrant checkpoint nested in the checkpoint being recomputed runs its forward
        again during this recompute, under a new node that its own recompute (later in the
        backward pass) will be matched by: the draws replayed now are recorded under every
        such node on the call stack, so that recompute replays them too."""
        token = checkpoint_token()
        found = self.get(token, what)
        if found is _MISSING:
            if any(not same_draws(v, latest) for v in self.values()):
                raise ReplayError(
                    f"{what}: the recompute of an activation checkpoint could not be matched to the "
                    "forward call it replays, and another checkpointed call of the same layer is still "
                    "pending with other random draws, so its gradient would belong to other draws. "
                    "This happens when further saved-tensor hooks (save_on_cpu) run inside the "
                    "checkpoint, with a non-reentrant checkpoint nested in another checkpoint, or "
                    "on a torch whose checkpoint internals differ. Backpropagate each checkpointed "
                    "call before the next training call of this layer, drop the inner hooks, do not "
                    "nest the checkpoints, or make the draws fixed (redraw_every=0, an eval-mode layer)."
                )
            found = latest
        try:
            inner = _reentrant_contexts()
        except Exception:  # pragma: no cover - defensive: never fail a recompute over this
            inner = []
        for ctx in inner:
            if ctx is not token:
                self.add(ctx, found)
        return found


def after_backward(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the backward pass that runs now ends (the autograd engine's
    ``queue_callback``); whether it could be queued (not outside a backward pass)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]
    except Exception:  # no backward pass runs: the caller restores lazily
        return False
    return True


def _drawn(module: nn.Module) -> dict[str, torch.Tensor | None]:
    skip = getattr(module, "_not_drawn", ())
    return {n: t for n, t in module._buffers.items() if n not in skip}


class MapState:
    """The buffers of a feature map (and of its submodules) as one call saw them: the
    tensor objects themselves, not copies. Two states are equal when they hold the same
    objects. Keeping one is free as long as a redraw makes new tensors, which
    :meth:`RedrawPolicy.before_forward` ensures before every scheduled redraw
    (:meth:`detach_from`). A module's buffers named in its ``_not_drawn`` attribute (state
    that is not a draw, kept by the module itself: CEXP's :math:`A` and statistics) are
    left out."""

    __slots__ = ("buffers",)

    def __init__(self, feature_map: nn.Module) -> None:
        self.buffers = [(m, _drawn(m)) for m in feature_map.modules()]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MapState) or len(self.buffers) != len(other.buffers):
            return False
        for (m, a), (n, b) in zip(self.buffers, other.buffers):
            if m is not n or a.keys() != b.keys() or any(a[k] is not b[k] for k in a):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]

    @staticmethod
    def detach_from(feature_map: nn.Module) -> None:
        """Give ``feature_map`` copies of its buffers, so that an in-place redraw leaves
        the tensors a recorded state holds as they are."""
        with torch.inference_mode(False):  # ordinary tensors, also for a redraw under inference mode
            for m in feature_map.modules():
                for name, t in _drawn(m).items():
                    if t is not None:
                        m._buffers[name] = t.clone()

    def show(self) -> None:
        """Put these buffers back in their modules (caches derived from buffers must be
        keyed by the buffer objects to follow)."""
        for m, buffers in self.buffers:
            m._buffers.update(buffers)


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
        #: ``(seed, draw)`` of checkpointed training calls whose recompute may still come
        self._pending = PendingDraws()
        #: the map's buffers of the last training call while a recompute shows another's
        self._latest: MapState | None = None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        # loaded draws are never overwritten by a restore still pending from a recompute
        # (a backward pass that raised before its end): the map keeps what is loaded into it
        self._latest = None
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

        A checkpoint recompute (:func:`recomputing`) advances nothing: the map shows the
        draw of the forward call it replays. A training call inside an activation
        checkpoint records the map's buffers (:class:`MapState`, no copy; kept in
        :class:`PendingDraws` until its checkpoint's graph is freed, and a redraw while one
        is kept draws into new tensors); a recompute of an earlier call than the last one
        puts that call's buffers in the map for its forward computation, and the caller
        puts the last call's back right after it (:meth:`end_replay`, in a ``finally``;
        else at the end of the backward pass, :func:`after_backward`, or at the next
        training call). The gradients, the map's state and the schedule are therefore
        those of the same calls without checkpointing. A recompute that cannot be matched
        to its call while another pending call used another draw raises
        :class:`ReplayError`."""
        if not training:
            return
        if recomputing():
            self._replay(feature_map)
            return
        self._end_replay()
        self.agree(feature_map)
        if self.every != 0 and feature_map.random:
            self._advance(feature_map)
        if feature_map.random:
            token = checkpoint_token()
            if token is not None:
                self._pending.add(token, MapState(feature_map))

    def _advance(self, feature_map: FeatureMap) -> None:
        """Count one training call and redraw ``feature_map`` when it is due. Host work on
        the schedule's counters and a generator: under ``torch.compile`` it runs eagerly,
        between two graphs, and ``fullgraph=True`` refuses it with
        :data:`REDRAW_UNDER_COMPILE`."""
        if torch.compiler.is_compiling():  # tracing: torch._dynamo is loaded (no import at module level)
            torch._dynamo.graph_break(msg=REDRAW_UNDER_COMPILE)
        step = int(self.step)
        if step > 0 and step % self.every == 0:
            self._settle_seed()
            self.draws += 1
            # the redraw writes into new tensors: a pending recompute, or a graph not yet
            # differentiated that saved the current ones (a compiled call two calls back),
            # still needs them as they are
            MapState.detach_from(feature_map)
            feature_map.redraw(generator=self.generator())
        self.step += 1

    def _replay(self, feature_map: FeatureMap) -> None:
        """Show ``feature_map`` the draw of the call the current recompute replays, until
        :meth:`end_replay` (or the end of the backward pass, :meth:`_end_replay`)."""
        if not feature_map.random or not feature_map.built:
            return
        shown = MapState(feature_map)
        latest = self._latest if self._latest is not None else shown
        want = self._pending.replay(latest, f"{type(feature_map).__name__} (redraw_every={self.every})")
        if want == shown:
            return
        want.show()  # type: ignore[attr-defined]
        if self._latest is None:
            self._latest = latest
            after_backward(self._end_replay)

    def end_replay(self, feature_map: FeatureMap) -> None:
        """After the forward computation of a checkpoint recompute: put the last training
        call's buffers back in ``feature_map`` if the recompute showed it another call's,
        and let the map's modules end replays of state of their own (a module's
        ``_end_replay()``, as CEXP's :math:`A`). A no-op outside a recompute and when
        nothing else was shown.

        Call it in a ``finally`` right after the computation that used the replayed draws
        (the recomputed graph holds the tensors it needs: the shown buffers themselves,
        or the grouped engine's own copies), so that a backward pass that raises later (a
        gradient hook, a non-finite guard) or a non-reentrant recompute stopped early never
        leaves an earlier call's draws in the map."""
        if self._latest is None and not recomputing():
            return
        self._end_replay()
        for m in feature_map.modules():
            end = getattr(m, "_end_replay", None)
            if callable(end):
                end()

    def _end_replay(self) -> None:
        """Put the last training call's buffers back in the map after a recompute that
        showed it an earlier call's (:meth:`end_replay`; else queued at the end of that
        backward pass, and also at the next training call, in case neither ran)."""
        if self._latest is not None:
            latest, self._latest = self._latest, None
            latest.show()

    def extra_repr(self) -> str:
        return f"every={self.every}, seed={int(self.seed)}"
