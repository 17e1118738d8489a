"""Names a package offers, imported from their modules on first use (PEP 562).

`import fsdp_lab` and every topic package stay free of torch, which takes seconds to import:
`fsdp-lab --help` and a lab's config (`fsdp_lab.sharding.lab.config`, whose import runs
`fsdp_lab/sharding/__init__.py` first) load at once, and the mechanism comes with the first
name that needs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(
    package: str, where: dict[str, str], names: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`: each public name -> the module defining it
    (a name the module does not define, such as its own: the module itself). `names` is the package's globals(), where a name
    is kept once found, so later lookups never come back here."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where[name])
        value = getattr(module, name, module)
        names[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*names, *where})

    return __getattr__, __dir__
