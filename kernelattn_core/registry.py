"""The plugin registry: discovery through pluggy and the ``kernelattn`` entry points.

Library code talks to :class:`Registry` (a typed facade); nothing else touches the
pluggy hook relay. This module is also where registry names are turned into classes
(:func:`resolve`, :func:`resolve_class`; the former ``kernelattn_core.lookup``):
:func:`kernelattn_core.create` resolves every name it is given here and hands classes and
instances to what it builds. Built-ins are registered first, then every entry point of the
``kernelattn`` group in name order.

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
"""

from __future__ import annotations

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
from .errors import PluginError, PluginWarning, UnknownNameError
from .experiments import Experiment
from .interfaces import AttentionEstimator, FeatureMap, Kernel, Normalizer
from .interfaces import names as _names
from .interfaces.names import construct

ENTRY_POINT_GROUP = "kernelattn"
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]*$")

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
        """The class's capability data, by name."""
        out: dict[str, Any] = {flag: getattr(self.cls, flag) for flag in KINDS[self.kind][2]}
        if self.kind == "feature_map":
            out["kernel"] = self.cls.kernel
        if self.kind == "kernel":
            out["family"] = self.cls.family.value
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
        """Register every entry point of the ``kernelattn`` group not blocked."""
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
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

    def register_plugin(
        self, plugin: object, name: str, *, distribution: str | None = None, version: str | None = None
    ) -> PluginInfo:
        """Register ``plugin`` (a module or object with hook implementations) under ``name``
        and collect its classes. Usable at run time for plugins without an entry point."""
        info = PluginInfo(name, distribution, version)
        if name in self._plugins:
            raise PluginError(f"kernelattn plugin {name!r}: a plugin of that name is already registered")
        self._plugins[name] = info
        spec = _required_spec(plugin)
        if spec is None or not spec_compatible(spec):
            self._problem(
                name,
                f"requires plugin spec {getattr(plugin, 'KERNELATTN_SPEC', None)!r} (KERNELATTN_SPEC), but this "
                f"kernelattn-core provides spec {hookspecs.SPEC_VERSION} (same major version, minor not newer)",
            )
            return info
        info.spec = spec
        try:
            self._pm.register(plugin, name=name)
        except Exception as exc:
            self._problem(name, f"could not be registered: {type(exc).__name__}: {exc}")
            return info
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
        return info

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
        names = [name, *vars(cls).get("aliases", ())]
        for n in names:
            taken = self._entries.get(self._aliases.get(n, n))
            if taken is not None:
                self._problem(
                    info.name,
                    f"duplicate registry name {n!r}: class {label} (plugin {info.name!r}) and class "
                    f"{taken.cls.__qualname__} (plugin {taken.plugin!r}); the second one is skipped",
                )
                return
        entry = Entry(name, kind, cls, info.name)
        self._entries[name] = entry
        for alias in names[1:]:
            self._aliases[alias] = name
        info.entries.append(entry)

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
]
