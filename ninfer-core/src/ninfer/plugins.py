"""Plugin discovery and the architecture registry.

Plugins are modules named by entry points in the group ``ninfer``. Loading is
deterministic (entry points sorted by name), a plugin that fails to import is
reported by name without hiding the others, and two plugins claiming the same
architecture are rejected with an error naming both.

Environment:
    NINFER_PLUGINS                 comma-separated allowlist of entry-point names ("" loads none; unset loads all)
    NINFER_DISABLE_PLUGIN_AUTOLOAD set to load no entry points at all
    NINFER_EXTRA_PLUGINS           comma-separated module names registered as plugins (no metadata needed)
    NINFER_STRICT_PLUGINS          set to make a plugin import failure an exception
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import traceback
from collections.abc import Iterable
from typing import Any

import attrs
import pluggy

from ninfer import env, hookspecs
from ninfer._markers import ENTRY_POINT_GROUP, PROJECT

log = logging.getLogger(__name__)

# Contract slots an architecture may fill, each a lazy "module:attr" target: what the runtime loads (the engine
# its Startup; the converter and the loader its source mapping).
CONTRACT_SLOTS = ("startup", "source_mapping")


class PluginError(Exception):
    """A plugin could not be loaded or contradicts another plugin."""


class PluginConflict(PluginError):
    """Two plugins claim the same architecture or Hugging Face architecture name."""


class UnknownArchitecture(LookupError):
    """No installed plugin handles the requested architecture."""


def _check_target(instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and (value.count(":") != 1 or not all(value.split(":"))):
        raise ValueError(f"{attribute.name} target must look like 'package.module:attr', got {value!r}")


@attrs.frozen(kw_only=True)
class ArchitectureSpec:
    """What an architecture plugin provides, as lazy ``"module:attr"`` targets.

    ``handles`` lists the Hugging Face ``architectures`` strings (config.json) this
    architecture implements. ``startup``: its ``ninfer.contract.Startup`` class (the engine
    builds the config, Frontend, state layout and Program through it). ``source_mapping``: its
    ``ninfer.artifact.mapping.SourceMapping`` factory (the converter and the loader). A slot left
    ``None`` is not provided (yet); consumers report that clearly instead of guessing.

    ``tiny_checkpoint`` (a tool, not a runtime slot): the maker ``ninfer tiny-checkpoint --arch NAME`` calls,
    ``maker(out_dir, *, seed, layers, vl, mtp, variant)``, writing a tiny random Hugging Face checkpoint into
    ``out_dir`` and raising ValueError for a choice it does not offer (``ninfer.cli.tiny_checkpoint``).
    """

    name: str = attrs.field(validator=attrs.validators.matches_re(r"^[a-z][a-z0-9_]*$"))
    handles: tuple[str, ...] = attrs.field(converter=tuple)
    description: str = ""
    startup: str | None = attrs.field(default=None, validator=_check_target)
    source_mapping: str | None = attrs.field(default=None, validator=_check_target)
    tiny_checkpoint: str | None = attrs.field(default=None, validator=_check_target)

    def provided(self) -> tuple[str, ...]:
        return tuple(slot for slot in CONTRACT_SLOTS if getattr(self, slot) is not None)

    def load(self, slot: str) -> Any:
        """Import and return the object behind one contract slot."""
        if slot not in CONTRACT_SLOTS:
            raise ValueError(f"unknown contract slot {slot!r}; expected one of {CONTRACT_SLOTS}")
        target = getattr(self, slot)
        if target is None:
            raise NotImplementedError(f"architecture {self.name!r} provides no {slot}")
        return load_target(target)


@attrs.frozen
class LoadedPlugin:
    name: str
    module: str
    distribution: str | None
    version: str | None


@attrs.frozen
class PluginFailure:
    name: str
    target: str
    error: str


@attrs.frozen
class RegisteredArchitecture:
    spec: ArchitectureSpec
    plugin: str


def load_target(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class PluginHost:
    """A pluggy manager plus what ninfer knows about each plugin it tried to load."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.loaded: list[LoadedPlugin] = []
        self.failures: list[PluginFailure] = []
        self._architectures: dict[str, RegisteredArchitecture] | None = None

    # -- loading -----------------------------------------------------------------------------------
    def register_module(self, module: Any, name: str, distribution: str | None = None,
                        version: str | None = None) -> None:
        self.pm.register(module, name=name)
        self.loaded.append(LoadedPlugin(name, getattr(module, "__name__", repr(module)), distribution, version))
        self._architectures = None

    def load_entry_points(self, entry_points: Iterable[importlib.metadata.EntryPoint],
                          allow: list[str] | None, strict: bool) -> None:
        seen: dict[str, str] = {}
        for ep in sorted(entry_points, key=lambda e: (e.name, e.value)):
            if allow is not None and ep.name not in allow:
                continue
            dist = ep.dist.name if ep.dist is not None else None
            if ep.name in seen:
                self.failures.append(PluginFailure(
                    ep.name, ep.value, f"entry point name {ep.name!r} from {dist} already taken by {seen[ep.name]}"))
                continue
            seen[ep.name] = str(dist)
            try:
                module = ep.load()
                self.register_module(module, ep.name, dist, ep.dist.version if ep.dist is not None else None)
            except Exception as exc:
                if strict:
                    raise PluginError(f"failed to load ninfer plugin {ep.name!r} ({ep.value}): {exc!r}") from exc
                log.warning("failed to load ninfer plugin %r (%s): %r", ep.name, ep.value, exc)
                self.failures.append(PluginFailure(ep.name, ep.value, "".join(
                    traceback.format_exception_only(type(exc), exc)).strip()))

    # -- architectures -----------------------------------------------------------------------------
    def architectures(self) -> dict[str, RegisteredArchitecture]:
        """All registered architectures by name; raises PluginConflict on any double claim."""
        if self._architectures is not None:
            return self._architectures
        found: dict[str, RegisteredArchitecture] = {}
        by_hf_name: dict[str, RegisteredArchitecture] = {}
        for impl in self.pm.hook.ninfer_register_architectures.get_hookimpls():
            plugin = impl.plugin_name

            def register(spec: ArchitectureSpec, _plugin: str = plugin) -> None:
                if not isinstance(spec, ArchitectureSpec):
                    raise PluginError(f"plugin {_plugin!r} registered {spec!r}, not an ArchitectureSpec")
                entry = RegisteredArchitecture(spec, _plugin)
                if spec.name in found:
                    raise PluginConflict(f"architecture {spec.name!r} is registered by two plugins: "
                                         f"{found[spec.name].plugin!r} and {_plugin!r}")
                for hf_name in spec.handles:
                    if hf_name in by_hf_name:
                        raise PluginConflict(
                            f"Hugging Face architecture {hf_name!r} is claimed by two plugins: "
                            f"{by_hf_name[hf_name].plugin!r} ({by_hf_name[hf_name].spec.name}) and "
                            f"{_plugin!r} ({spec.name})")
                    by_hf_name[hf_name] = entry
                found[spec.name] = entry

            impl.function(register=register)
        self._architectures = dict(sorted(found.items()))
        return self._architectures

    def architecture(self, name: str) -> RegisteredArchitecture:
        """Look an architecture up by ninfer name or by Hugging Face architecture string."""
        archs = self.architectures()
        if name in archs:
            return archs[name]
        for entry in archs.values():
            if name in entry.spec.handles:
                return entry
        known = ", ".join(f"{n} ({', '.join(e.spec.handles)})" for n, e in archs.items()) or "none"
        raise UnknownArchitecture(f"no installed ninfer plugin handles architecture {name!r}; known: {known}")


def make_plugin_host(*, autoload: bool | None = None, strict: bool | None = None,
                     entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> PluginHost:
    """Build a fresh PluginHost from installed entry points and the environment."""
    if autoload is None:
        autoload = not env.get("NINFER_DISABLE_PLUGIN_AUTOLOAD")
    if strict is None:
        strict = env.get("NINFER_STRICT_PLUGINS")
    host = PluginHost()
    if autoload:
        if entry_points is None:
            entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        allow = env.get("NINFER_PLUGINS")
        host.load_entry_points(entry_points, None if allow is None else list(allow), strict)
    for module_name in env.get("NINFER_EXTRA_PLUGINS"):
        if module_name in {p.module for p in host.loaded}:
            continue
        try:
            host.register_module(importlib.import_module(module_name), module_name)
        except Exception as exc:
            if strict:
                raise PluginError(f"failed to load extra ninfer plugin {module_name!r}: {exc!r}") from exc
            host.failures.append(PluginFailure(module_name, module_name, repr(exc)))
    host.pm.check_pending()
    return host


@functools.cache
def default_host() -> PluginHost:
    """The process-wide host, built on first use from the installed plugins."""
    return make_plugin_host()
