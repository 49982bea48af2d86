"""The plugin registry: discovery through pluggy and the ``kernelattn`` entry points.

Library code talks to :class:`Registry` (a typed facade); nothing else touches the
pluggy hook relay. This module is also where registry names are turned into classes
(:func:`resolve`, :func:`resolve_class`; the former ``kernelattn_core.lookup``):
:func:`kernelattn_core.create` resolves every name it is given here and hands classes and
instances to what it builds. Built-ins are registered first, then the entry points of the
plugins shipped with kernelattn (:data:`SHIPPED_DISTRIBUTIONS`), then every other entry
point of the ``kernelattn`` group, each group in name order. A registry name (or alias)
belongs to the first class registered under it: a later class claiming it is skipped, and
the warning names the later class and its plugin (so a third-party plugin cannot take the
name of a shipped class, whatever its entry-point name).

:func:`target_kernel_name` and :func:`target_kernel_type` read the kernel a feature map
targets from either form a map may declare it in (``target_kernel_class``, spec 1.1+, or
the registry name ``kernel``), the way
:meth:`~kernelattn_core.interfaces.FeatureMap.target_kernel` resolves it: every reader of
a map's target (the listing, ``kernelattn verify``, ``compare``) should call them rather
than read ``kernel``.

Environment switches
--------------------
``KERNELATTN_DISABLE_PLUGIN_AUTOLOAD=1``
    Skip entry points; only built-ins (and plugins registered by hand) are present.
``KERNELATTN_BLOCK_PLUGINS=name1,name2``
    Skip the named entry points.
``KERNELATTN_TRACE_HOOKS=1``
    Print every hook call and what it returned to stderr.

A plugin that fails to import (``SystemExit`` included; ``KeyboardInterrupt`` still
propagates), raises in a hook, or returns a bad class is reported
as a :class:`~kernelattn_core.errors.PluginWarning` naming the plugin and the error;
its good classes and every other plugin keep working. ``strict=True`` turns those
warnings into :class:`~kernelattn_core.errors.PluginError`.

A bad class is one that breaks a rule of the plugin spec (``spec/plugins.rst``): not a
concrete subclass of the hook's interface, a ``name`` or an alias that is not a registry
name (``aliases`` a tuple of names, never a str), a capability flag that is not a bool, a
kernel ``family`` that is no :class:`~kernelattn_core.interfaces.KernelFamily` value (a
valid value given as a str is converted), a ``claims`` entry that is not a claim instance
(a rule ID, a claim class without ``()``), a ``target_kernel_class`` that is no Kernel
subclass, or a name already taken. Once every plugin of a load has registered (names may
refer to other plugins' classes), a feature map whose ``kernel`` or
``default_normalizer`` names no registered kernel or normaliser is reported and removed.
A plugin module with a function that looks like a hook but is none (a hook name without
:data:`~kernelattn_core.hookimpl`, ``kernelattn_feature_map`` for
``kernelattn_feature_maps``) is reported too: it would register nothing, silently.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from . import hookspecs
from .claims import Claim
from .errors import PluginError, PluginWarning, UnknownNameError
from .experiments import Experiment
from .interfaces import AttentionEstimator, FeatureMap, Kernel, KernelFamily, Normalizer
from .interfaces import names as _names
from .interfaces.names import construct

ENTRY_POINT_GROUP = "kernelattn"
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]*$")
#: an alias: the characters of a name, and ``+`` (``favor+``, an alias the shipped plugins use)
ALIAS_PATTERN = re.compile(r"^[a-z0-9][a-z0-9+-]*$")

#: the distributions of the plugins shipped with kernelattn (``plugins/`` of its repository):
#: their entry points load right after the built-ins, so their names are theirs whatever
#: a third-party plugin, loaded later, declares
SHIPPED_DISTRIBUTIONS = frozenset(
    {
        "kernelattn-fourier",
        "kernelattn-hybrid",
        "kernelattn-maclaurin",
        "kernelattn-prf",
        "kernelattn-sampling",
        "kernelattn-spectral",
    }
)

#: every hook a plugin may implement (the functions of :mod:`kernelattn_core.hookspecs`)
HOOK_NAMES: tuple[str, ...] = tuple(sorted(n for n in vars(hookspecs) if n.startswith("kernelattn_")))
#: how close (:class:`difflib.SequenceMatcher` ratio) an unmarked function's name must be to a
#: hook's to be reported as a misspelt hook
_NEAR_MISS = 0.85

#: kind -> (interface, hook name, boolean capability flags that must be bools)
KINDS: dict[str, tuple[type, str, tuple[str, ...]]] = {
    "kernel": (Kernel, "kernelattn_kernels", ("positive",)),
    "feature_map": (
        FeatureMap,
        "kernelattn_feature_maps",
        ("unbiased", "positive", "learnable", "random", "log_space", "has_budget"),
    ),
    "normalizer": (Normalizer, "kernelattn_normalizers", ("learnable",)),
    "estimator": (
        AttentionEstimator,
        "kernelattn_estimators",
        ("unbiased", "consistent", "supports_causal", "random", "has_budget", "linear"),
    ),
}


@dataclass(frozen=True)
class Entry:
    """One registered class."""

    name: str
    kind: str
    cls: type
    plugin: str

    def flags(self) -> dict[str, Any]:
        """The class's capability data, by name (a feature map's ``kernel`` is its target
        kernel's name in either form, :func:`target_kernel_name`)."""
        out: dict[str, Any] = {flag: getattr(self.cls, flag, None) for flag in KINDS[self.kind][2]}
        if self.kind == "feature_map":
            out["kernel"] = target_kernel_name(self.cls)
        if self.kind == "kernel":
            family = getattr(self.cls, "family", None)
            out["family"] = family.value if isinstance(family, KernelFamily) else str(family)
        return out


@dataclass
class PluginInfo:
    """One plugin: where it comes from and what it registered."""

    name: str
    distribution: str | None = None
    version: str | None = None
    entries: list[Entry] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: the spec version the plugin was written against (its ``KERNELATTN_SPEC``; "1.0" when absent)
    spec: str = "1.0"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


class Registry:
    """All registered kernels, feature maps, normalizers and estimators.

    Parameters
    ----------
    autoload : bool, optional
        Load entry points; by default unless ``KERNELATTN_DISABLE_PLUGIN_AUTOLOAD`` is set.
    block : iterable of str
        Entry-point names to skip, added to ``KERNELATTN_BLOCK_PLUGINS``.
    strict : bool
        Raise :class:`PluginError` instead of warning on a bad plugin.
    builtins : bool
        Register the built-in classes (default ``True``).
    """

    def __init__(
        self,
        *,
        autoload: bool | None = None,
        block: Iterable[str] = (),
        strict: bool = False,
        builtins: bool = True,
    ) -> None:
        self.strict = strict
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self.trace = _truthy(os.environ.get("KERNELATTN_TRACE_HOOKS"))
        self._entries: dict[str, Entry] = {}
        self._aliases: dict[str, str] = {}
        self._plugins: dict[str, PluginInfo] = {}
        self._experiments: dict[str, tuple[Experiment, str]] = {}
        env_block = os.environ.get("KERNELATTN_BLOCK_PLUGINS", "")
        self.blocked = {b.strip() for b in env_block.split(",") if b.strip()} | set(block)
        #: while > 0, :meth:`register_plugin` leaves the check of names that refer to other
        #: classes to the end of the load (:meth:`load_entry_points`)
        self._deferring = 0
        if builtins:
            from .builtins import plugin as builtin_plugin

            info = self.register_plugin(builtin_plugin, "builtins", distribution="kernelattn-core", version=_version())
            info.spec = hookspecs.SPEC_VERSION  # the core's own classes follow its spec
        if autoload is None:
            autoload = not _truthy(os.environ.get("KERNELATTN_DISABLE_PLUGIN_AUTOLOAD"))
        if autoload:
            self.load_entry_points()

    # ------------------------------------------------------------------ loading
    def _problem(self, plugin: str, message: str) -> None:
        text = f"kernelattn plugin {plugin!r}: {message}"
        if self.strict:
            raise PluginError(text)
        warnings.warn(text, PluginWarning, stacklevel=3)
        if plugin in self._plugins:
            self._plugins[plugin].errors.append(message)

    def load_entry_points(self) -> None:
        """Register every entry point of the ``kernelattn`` group not blocked: those of the
        shipped plugins (:data:`SHIPPED_DISTRIBUTIONS`) first, then the others, each in name
        order; then check the names their feature maps refer to (:meth:`_check_references`)."""
        first = len(self._plugins)
        self._deferring += 1
        try:
            for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=_load_order):
                if ep.name in self.blocked or ep.name in self._plugins:
                    continue
                dist = getattr(ep, "dist", None)
                dist_name = dist.name if dist is not None else None
                dist_version = dist.version if dist is not None else None
                try:
                    obj = ep.load()
                except (Exception, SystemExit) as exc:  # SystemExit too: a plugin must not end the process
                    # (KeyboardInterrupt and GeneratorExit still propagate)
                    self._plugins[ep.name] = PluginInfo(ep.name, dist_name, dist_version)
                    self._problem(ep.name, f"failed to import {ep.value!r}: {type(exc).__name__}: {exc}")
                    continue
                self.register_plugin(obj, ep.name, distribution=dist_name, version=dist_version)
        finally:
            self._deferring -= 1
        if not self._deferring:
            self._check_references(list(self._plugins.values())[first:])

    def register_plugin(
        self, plugin: object, name: str, *, distribution: str | None = None, version: str | None = None
    ) -> PluginInfo:
        """Register ``plugin`` (a module or object with hook implementations) under ``name``
        and collect its classes. Usable at run time for plugins without an entry point.

        The names its feature maps refer to (``kernel``, ``default_normalizer``) are checked
        once it has registered, against every class registered by then (at the end of
        :meth:`load_entry_points` for the plugins it loads)."""
        info = PluginInfo(name, distribution, version)
        if name in self._plugins:
            raise PluginError(f"kernelattn plugin {name!r}: a plugin of that name is already registered")
        self._plugins[name] = info
        spec = _required_spec(plugin)
        if spec is None:
            value = getattr(plugin, "KERNELATTN_SPEC", None)
            self._problem(
                name,
                f"requires plugin spec: unknown, KERNELATTN_SPEC = {value!r} (a {type(value).__name__}) is "
                f"malformed: expected a string 'MAJOR.MINOR' naming the spec the plugin was written against, "
                f"such as KERNELATTN_SPEC = {hookspecs.SPEC_VERSION!r} (this kernelattn-core provides spec "
                f"{hookspecs.SPEC_VERSION})",
            )
            return info
        if not spec_compatible(spec):
            self._problem(
                name,
                f"requires plugin spec {spec!r} (KERNELATTN_SPEC), but this kernelattn-core provides spec "
                f"{hookspecs.SPEC_VERSION} (same major version, minor not newer)",
            )
            return info
        info.spec = spec
        try:
            self._pm.register(plugin, name=name)
        except Exception as exc:
            self._problem(name, f"could not be registered: {type(exc).__name__}: {exc}")
            return info
        self._check_hook_names(plugin, info)
        for kind, (_, hook_name, _) in KINDS.items():
            caller = getattr(self._pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                if impl.plugin is not plugin:
                    continue
                try:
                    result = self._call(impl, hook_name, name)
                except (Exception, SystemExit) as exc:
                    self._problem(name, f"hook {hook_name} raised {type(exc).__name__}: {exc}")
                    continue
                if result is None:
                    continue
                if not isinstance(result, list | tuple):
                    self._problem(name, f"hook {hook_name} must return a list of classes, got {type(result).__name__}")
                    continue
                for cls in result:
                    self._add(kind, cls, info)
        self._collect_experiments(plugin, info)
        if not self._deferring:
            self._check_references([info])
        return info

    def _check_hook_names(self, plugin: object, info: PluginInfo) -> None:
        """Report the functions of ``plugin`` that look like hooks but are none, which
        would make it register nothing without a word: a function marked with
        :data:`~kernelattn_core.hookimpl` under a name that is no hook (pluggy keeps such an
        implementation "pending"), a hook name without the marker, and an unmarked function
        whose name is a near miss of a hook the plugin does not implement
        (``kernelattn_feature_map``)."""
        # hasattr first: pluggy before 1.7 reads getattr(plugin, name) with no default
        implemented = {
            n for n in HOOK_NAMES if hasattr(plugin, n) and self._pm.parse_hookimpl_opts(plugin, n) is not None
        }
        for attr in sorted(dir(plugin)):
            if attr.startswith("_"):
                continue
            try:
                value = getattr(plugin, attr)
            except Exception:  # a property of a plugin object that raises: not a hook
                continue
            if not inspect.isroutine(value):
                continue
            marked = self._pm.parse_hookimpl_opts(plugin, attr) is not None
            if attr in HOOK_NAMES:
                if not marked:
                    self._problem(
                        info.name,
                        f"{attr} is not marked with @kernelattn_core.hookimpl, so it is never called "
                        f"(its classes are not registered)",
                    )
                continue
            close = difflib.get_close_matches(attr, HOOK_NAMES, n=1, cutoff=0.6 if marked else _NEAR_MISS)
            if marked:
                hint = f"; did you mean {close[0]!r}?" if close else ""
                self._problem(
                    info.name,
                    f"@hookimpl function {attr!r} implements no kernelattn hook{hint} (the hooks: "
                    f"{', '.join(HOOK_NAMES)}); it is never called",
                )
            elif close and close[0] not in implemented:
                self._problem(
                    info.name,
                    f"function {attr!r} is not a kernelattn hook; did you mean {close[0]!r} "
                    f"(marked with @kernelattn_core.hookimpl)? It is never called",
                )

    def _collect_experiments(self, plugin: object, info: PluginInfo) -> None:
        for impl in self._pm.hook.kernelattn_experiments.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            try:
                result = self._call(impl, "kernelattn_experiments", info.name) or []
            except (Exception, SystemExit) as exc:
                self._problem(info.name, f"hook kernelattn_experiments raised {type(exc).__name__}: {exc}")
                continue
            for exp in result:
                if not isinstance(exp, Experiment) or not NAME_PATTERN.match(exp.name):
                    self._problem(info.name, f"kernelattn_experiments returned {exp!r}, not a named Experiment")
                elif exp.name in self._experiments:
                    other = self._experiments[exp.name][1]
                    self._problem(info.name, f"duplicate experiment name {exp.name!r} (also in plugin {other!r})")
                else:
                    self._experiments[exp.name] = (exp, info.name)

    def experiments(self) -> dict[str, Experiment]:
        """Experiments contributed by plugins, by name."""
        return {name: exp for name, (exp, _) in self._experiments.items()}

    def _call(self, impl: Any, hook_name: str, plugin: str) -> Any:
        """Call one plugin's implementation of a hook (each plugin alone, so that one
        failing plugin cannot take the others down), tracing it when asked."""
        if self.trace:
            print(f"kernelattn: calling {hook_name} of plugin {plugin!r}", file=sys.stderr)
        result = impl.function()
        if self.trace:
            got = [getattr(c, "name", repr(c)) for c in result] if isinstance(result, list | tuple) else result
            print(f"kernelattn: {hook_name} of plugin {plugin!r} returned {got}", file=sys.stderr)
        return result

    def _add(self, kind: str, cls: object, info: PluginInfo) -> None:
        interface, hook_name, flags = KINDS[kind]
        label = getattr(cls, "__qualname__", repr(cls))
        if not isinstance(cls, type) or not issubclass(cls, interface):
            self._problem(info.name, f"{hook_name} returned {label}, which is not a subclass of {interface.__name__}")
            return
        if inspect.isabstract(cls):
            missing = sorted(getattr(cls, "__abstractmethods__", ()))
            self._problem(
                info.name, f"class {label} does not implement {interface.__name__}: abstract methods {missing}"
            )
            return
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            self._problem(
                info.name,
                f"class {label} needs a registry name of lower-case letters, digits and '-', got {name!r}",
            )
            return
        for flag in flags:
            if not isinstance(getattr(cls, flag), bool):
                self._problem(info.name, f"class {label}: capability flag {flag!r} must be a bool")
                return
        # aliases are not inherited: a subclass of an aliased class must not claim its aliases
        aliases = _alias_problem(vars(cls).get("aliases", ()))
        if isinstance(aliases, str):
            self._problem(info.name, f"class {label} ({name!r}): {aliases}")
            return
        problem = _class_data_problem(kind, cls)
        if problem is not None:
            self._problem(info.name, f"class {label} ({name!r}): {problem}")
            return
        names = [name, *dict.fromkeys(a for a in aliases if a != name)]
        for n in names:
            taken = self._entries.get(self._aliases.get(n, n))
            if taken is not None:
                what = "registry name" if n == name else "alias"
                self._problem(
                    info.name,
                    f"duplicate registry name {n!r}: class {label} (plugin {info.name!r}) is skipped, because "
                    f"class {taken.cls.__qualname__} of plugin {taken.plugin!r}, registered before it, already "
                    f"has the name {n!r}; choose another {what} for {label}",
                )
                return
        if kind == "kernel" and not isinstance(cls.family, KernelFamily):
            cls.family = KernelFamily(cls.family)  # a valid value given as a str (checked above)
        entry = Entry(name, kind, cls, info.name)
        self._entries[name] = entry
        for alias in names[1:]:
            self._aliases[alias] = name
        info.entries.append(entry)

    def _check_references(self, plugins: Iterable[PluginInfo]) -> None:
        """Report and remove the feature maps of ``plugins`` whose ``kernel`` or
        ``default_normalizer`` (names, checked once every plugin of a load has registered,
        since they may name another plugin's class) name no registered kernel or normaliser."""
        for info in plugins:
            for entry in list(info.entries):
                if entry.kind != "feature_map":
                    continue
                problem = self._reference_problem(entry.cls)
                if problem is None:
                    continue
                self._problem(
                    info.name,
                    f"class {entry.cls.__qualname__} ({entry.name!r}): {problem}; the class is not registered",
                )
                self._remove(entry, info)

    def _reference_problem(self, cls: type) -> str | None:
        """What is wrong with the names a feature-map class refers to, or ``None``."""
        if getattr(cls, "target_kernel_class", None) is None:
            kernel = getattr(cls, "kernel", None)
            if kernel is not None and (not isinstance(kernel, str) or not self._known(kernel, "kernel")):
                known = ", ".join(sorted(self.names("kernel")))
                hint = "" if isinstance(kernel, str) else " (a class goes in target_kernel_class)"
                return f"kernel = {kernel!r} is not the name of a registered kernel{hint}; the kernels are: {known}"
        normalizer = getattr(cls, "default_normalizer", "row")
        if isinstance(normalizer, str) and not self._known(normalizer, "normalizer"):
            known = ", ".join(sorted(self.names("normalizer")))
            return (
                f"default_normalizer = {normalizer!r} is not the name of a registered normalizer; "
                f"the normalizers are: {known}"
            )
        return None

    def _known(self, name: str, kind: str) -> bool:
        entry = self._entries.get(self._aliases.get(name, name))
        return entry is not None and entry.kind == kind

    def _remove(self, entry: Entry, info: PluginInfo) -> None:
        """Take ``entry`` (and its aliases) out of the registry."""
        self._entries.pop(entry.name, None)
        for alias in [a for a, n in self._aliases.items() if n == entry.name]:
            del self._aliases[alias]
        info.entries = [e for e in info.entries if e is not entry]

    # ------------------------------------------------------------------ lookup
    def get(self, name: str, kind: str | None = None) -> Entry:
        """The entry of ``name`` (or an alias), optionally of one ``kind``."""
        entry = self._entries.get(self._aliases.get(name, name)) if isinstance(name, str) else None
        if entry is None or (kind is not None and entry.kind != kind):
            available = ", ".join(sorted(e.name for e in self.entries(kind)))
            what = kind.replace("_", " ") if kind else "class"
            raise UnknownNameError(f"unknown {what} name {name!r}; available: {available}")
        return entry

    def kernel(self, name: str) -> type[Kernel]:
        return self.get(name, "kernel").cls

    def feature_map(self, name: str) -> type[FeatureMap]:
        return self.get(name, "feature_map").cls

    def normalizer(self, name: str) -> type[Normalizer]:
        return self.get(name, "normalizer").cls

    def estimator(self, name: str) -> type[AttentionEstimator]:
        return self.get(name, "estimator").cls

    def entries(self, kind: str | None = None) -> list[Entry]:
        """Registered entries in registration order, optionally of one kind."""
        return [e for e in self._entries.values() if kind is None or e.kind == kind]

    def names(self, kind: str | None = None) -> list[str]:
        return [e.name for e in self.entries(kind)]

    def plugins(self) -> list[PluginInfo]:
        """Every plugin seen, in registration order (failed ones included, with errors)."""
        return list(self._plugins.values())

    def plugin_of(self, name: str) -> PluginInfo:
        """The plugin that registered class ``name``."""
        return self._plugins[self.get(name).plugin]


def _load_order(ep: Any) -> tuple[bool, str]:
    """Sort key of an entry point: the shipped plugins first, then by name."""
    dist = getattr(ep, "dist", None)
    dist_name = re.sub(r"[-_.]+", "-", dist.name).lower() if dist is not None and dist.name else ""
    return (dist_name not in SHIPPED_DISTRIBUTIONS, ep.name)


def _alias_problem(aliases: object) -> tuple[str, ...] | str:
    """``aliases`` as a tuple of valid aliases, or the message saying why it is not one."""
    if isinstance(aliases, str):
        return (
            f"aliases must be a tuple of names, got the str {aliases!r} (which would make each of its "
            f"characters an alias); write aliases = ({aliases!r},)"
        )
    if not isinstance(aliases, tuple | list | frozenset | set):
        return f"aliases must be a tuple of names, got {type(aliases).__name__} {aliases!r}"
    bad = [a for a in aliases if not isinstance(a, str) or not ALIAS_PATTERN.match(a)]
    if bad:
        return (
            f"aliases {bad!r} are not registry names (lower-case letters, digits, '-' and '+', "
            f"starting with a letter or digit)"
        )
    return tuple(aliases)


def _class_data_problem(kind: str, cls: type) -> str | None:
    """What is wrong with the class data of ``cls`` beside its name, aliases and flags
    (``claims``; a kernel's ``family``; a feature map's ``target_kernel_class``), or ``None``."""
    claims = getattr(cls, "claims", ())
    if claims is None:
        claims = ()
    if isinstance(claims, str | Claim) or not isinstance(claims, tuple | list):
        return f"claims must be a tuple of claim instances, got {type(claims).__name__} {claims!r}"
    for i, claim in enumerate(claims):
        if isinstance(claim, Claim):
            continue
        if isinstance(claim, type) and issubclass(claim, Claim):
            return (
                f"claims entry {i} is the claim class {claim.__name__}, not a claim instance; "
                f"write {claim.__name__}(...) (with its options)"
            )
        hint = " (a rule ID? declare the claim itself, e.g. UnbiasedKernelEstimate())" if isinstance(claim, str) else ""
        return f"claims entry {i} is {claim!r}, not a claim instance{hint}"
    if kind == "kernel":
        family = getattr(cls, "family", None)
        valid = [f.value for f in KernelFamily]
        if not isinstance(family, KernelFamily) and not (isinstance(family, str) and family in valid):
            return f"family must be a KernelFamily (one of {valid}), got {family!r}"
    if kind == "feature_map":
        target = getattr(cls, "target_kernel_class", None)
        if target is not None and not (isinstance(target, type) and issubclass(target, Kernel)):
            return f"target_kernel_class must be a Kernel subclass or None, got {target!r}"
    return None


def target_kernel_name(feature_map: Any) -> str | None:
    """The name of the kernel a feature map targets, or ``None`` when it declares none.

    Reads both forms a map may declare its target in, in the order
    :meth:`~kernelattn_core.interfaces.FeatureMap.target_kernel` resolves them:
    ``target_kernel_class`` (spec 1.1+; its registry ``name``, else its class name) first,
    else ``kernel`` (a registry name). Call it instead of reading ``.kernel``, which is
    ``None`` for a map that declares its target as a class.

    Parameters
    ----------
    feature_map : FeatureMap subclass or instance
        A class gives its class data; an instance also what it set on itself (a map whose
        target depends on its options sets ``self.kernel``).

    Returns
    -------
    str or None

    Examples
    --------
    >>> from kernelattn_core.toolkit import EluFeatureMap, SoftmaxKernel
    >>> target_kernel_name(EluFeatureMap) is None
    True
    >>> target_kernel_name(type("M", (EluFeatureMap,), {"target_kernel_class": SoftmaxKernel}))
    'softmax'
    """
    target = getattr(feature_map, "target_kernel_class", None)
    if target is not None:
        return getattr(target, "name", None) or getattr(target, "__qualname__", repr(target))
    kernel = getattr(feature_map, "kernel", None)
    if kernel is None or isinstance(kernel, str):
        return kernel
    return getattr(kernel, "name", None) or getattr(kernel, "__qualname__", repr(kernel))


def target_kernel_type(feature_map: Any, registry: Registry | None = None) -> type[Kernel] | None:
    """The kernel class a feature map (class or instance) targets, or ``None`` when it
    declares none: its ``target_kernel_class``, else the class registered under its
    ``kernel`` name (in ``registry``, by default the process-wide one).

    Raises
    ------
    UnknownNameError
        When ``kernel`` names no registered kernel.
    """
    target = getattr(feature_map, "target_kernel_class", None)
    if target is not None:
        return target
    kernel = getattr(feature_map, "kernel", None)
    if kernel is None:
        return None
    if isinstance(kernel, type) and issubclass(kernel, Kernel):
        return kernel
    return (registry or get_registry()).kernel(kernel)


def _required_spec(plugin: object) -> str | None:
    """The plugin's ``KERNELATTN_SPEC`` as ``"MAJOR.MINOR"`` ("1.0" when absent), or None if malformed."""
    value = getattr(plugin, "KERNELATTN_SPEC", "1.0")
    if not isinstance(value, str) or not re.fullmatch(r"\d+\.\d+", value):
        return None
    return value


def spec_compatible(required: str, provided: str = hookspecs.SPEC_VERSION) -> bool:
    """Whether a plugin written against spec ``required`` loads with a core providing
    ``provided``: same major version, and the required minor version not newer."""
    r_major, r_minor = (int(p) for p in required.split("."))
    p_major, p_minor = (int(p) for p in provided.split("."))
    return r_major == p_major and r_minor <= p_minor


def _version() -> str | None:
    try:
        return metadata.version("kernelattn-core")
    except metadata.PackageNotFoundError:
        return None


_REGISTRY: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry()
    return _REGISTRY


def reload_plugins(**options: Any) -> Registry:
    """Rebuild the process-wide registry (after installing a plugin, or to apply
    changed environment switches); ``options`` go to :class:`Registry`."""
    global _REGISTRY
    _REGISTRY = Registry(**options)
    return _REGISTRY


def resolve(name: str, kind: str | None = None) -> Entry:
    """The entry of ``name`` in the process-wide registry (optionally of one ``kind``:
    ``"kernel"``, ``"feature_map"``, ``"normalizer"``, ``"estimator"``); raises
    :class:`~kernelattn_core.errors.UnknownNameError` listing the available names."""
    return get_registry().get(name, kind)


def resolve_class(name: str, kind: str) -> type:
    """The class registered as ``name`` of ``kind`` in the process-wide registry."""
    return resolve(name, kind).cls


def install_resolver(resolver: Any) -> None:
    """Make ``resolver(name, kind)`` the lookup of names given below the registry (what
    :func:`resolve` does by default); kept for callers of the former
    ``kernelattn_core.lookup.install_resolver``."""
    _names.install_resolver(resolver)


# Names given below the registry (``ExactAttention("gaussian")``, a feature map's
# ``kernel = "softmax"``) are resolved here: the interfaces never import this module.
_names.install_resolver(resolve)

__all__ = [
    "ENTRY_POINT_GROUP",
    "KINDS",
    "Entry",
    "PluginInfo",
    "Registry",
    "construct",
    "get_registry",
    "install_resolver",
    "reload_plugins",
    "resolve",
    "resolve_class",
    "spec_compatible",
    "target_kernel_name",
    "target_kernel_type",
]
