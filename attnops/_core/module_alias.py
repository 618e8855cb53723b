"""Stand-in packages: make ``import <name>`` (and its submodules) load an attnops module where the real package is
absent, as the torch_npu and flash-attn shims do. Nothing happens on import of this module."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


def real_package_present(name: str) -> bool:
    """Whether the real top-level package ``name`` is imported or importable (not an attnops stand-in)."""
    module = sys.modules.get(name)
    if module is not None:
        return not getattr(module, "__name__", "").startswith("attnops.")
    return importlib.util.find_spec(name) is not None


class _AliasLoader(importlib.abc.Loader):
    """Loads ``alias`` as the attnops module ``target``: the import returns that very module (its entry in
    ``sys.modules`` replaces the placeholder the import system made)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return None  # the default placeholder, replaced in exec_module

    def exec_module(self, module: types.ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.target)


class AliasFinder(importlib.abc.MetaPathFinder):
    """Maps ``alias`` and ``alias.sub.mod`` to ``target`` and ``target.sub.mod`` for each ``alias -> target`` of
    ``prefixes``; names whose target does not exist are left to the other finders (an ImportError as usual)."""

    def __init__(self, prefixes: dict[str, str]):
        self.prefixes = dict(prefixes)

    def _target(self, fullname: str) -> str | None:
        for alias, target in self.prefixes.items():
            if fullname == alias or fullname.startswith(alias + "."):
                return target + fullname[len(alias):]
        return None

    def find_spec(self, fullname, path=None, target=None):
        name = self._target(fullname)
        if name is None or importlib.util.find_spec(name) is None:
            return None
        module = importlib.import_module(name)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(name),
                                              is_package=hasattr(module, "__path__"))


def install_aliases(prefixes: dict[str, str]) -> None:
    """Route imports of each alias package in ``prefixes`` (and its submodules) to its attnops target, first in
    ``sys.meta_path`` (idempotent: an earlier finder for the same aliases is kept)."""
    for finder in sys.meta_path:
        if isinstance(finder, AliasFinder) and finder.prefixes == prefixes:
            return
    sys.meta_path.insert(0, AliasFinder(prefixes))
