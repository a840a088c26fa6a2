"""Lazy package attributes (PEP 562): a package's public names are imported from their submodules on first use."""

from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str],
                 on_access: Callable[[], None] | None = None) -> tuple[Callable[[str], object], Callable[[], list]]:
    """The module-level `__getattr__` and `__dir__` of `package`.

    `exports` maps each public name to the submodule that defines it (relative to `package`, e.g.
    `"modeling_chainflow"`); the submodule is imported when the name is first read, and the name is then kept on the
    package. `on_access` runs after each such first read. Any other name is an `AttributeError`, so that
    `from package import submodule` still imports a submodule.
    """

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)
        if on_access is not None:
            on_access()
        return value

    def __dir__() -> list:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
