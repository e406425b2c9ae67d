"""TRL's module paths under rlft: `from rlft.trainer.grpo_trainer import GRPOTrainer`,
`from rlft.experimental.async_grpo import AsyncGRPOTrainer`, ... work as TRL's do with the import
changed.

The modules are made from the kind rows (rlft/kinds.py: `trl_paths`, `deprecated_paths`) by a finder
on `sys.meta_path`; their names load on first use, so importing one loads no trainer until a name is
asked for. A deprecated path (TRL's `trl.experimental.distillation`) warns as TRL does, with rlft's
import in the message.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
import warnings

from rlft.kinds import KINDS, load

# module (without "rlft.") -> name -> ("module:name", deprecated)
_PATHS: dict[str, dict[str, tuple[str, bool]]] = {}
for _kind in KINDS.values():
    for _path in (*_kind.trl_paths, *_kind.deprecated_paths):
        _PATHS.setdefault(_path, {}).update(
            {name: (target, _path in _kind.deprecated_paths) for name, target in _kind.names().items()})


def _module(fullname: str, names: dict[str, tuple[str, bool]]) -> types.ModuleType:
    module = types.ModuleType(fullname, f"TRL's `trl.{fullname[5:]}` names, from rlft "
                                        "(rlft/kinds.py).")
    module.__all__ = sorted(names)
    # a package, so that TRL's deeper paths (experimental.async_grpo.async_rollout_worker) import under it
    module.__path__ = []

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {fullname!r} has no attribute {name!r}")
        target, deprecated = names[name]
        if deprecated:
            warnings.warn("This import path is deprecated (as in TRL, where it is removed in "
                          f"v2.0.0). The `{name}` has been promoted to the stable API. Update your "
                          f"imports to `from rlft import {name}`.", FutureWarning, stacklevel=2)
        return load(target)

    module.__getattr__ = __getattr__
    return module


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("rlft.") and fullname[5:] in _PATHS:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return _module(spec.name, _PATHS[spec.name[5:]])

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
