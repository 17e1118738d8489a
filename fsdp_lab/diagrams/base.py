"""`Diagram`: DOT source that shows as SVG in Jupyter and saves as .svg — or as .dot source
when graphviz's `dot` program is missing (an OS package, not a pip one), so a missing system
package never breaks a lesson."""

from __future__ import annotations

import functools
import os
import pathlib
import shutil
from collections.abc import Container

import graphviz

from fsdp_lab.outputs import write_file

MISSING_DOT_MESSAGE = (
    "graphviz's `dot` was not found on PATH (install the `graphviz` OS package or conda "
    "package); showing the DOT source instead"
)


def has_dot() -> bool:
    """Whether graphviz's `dot` executable is on PATH (checked each call: PATH may change)."""
    return shutil.which("dot") is not None


@functools.cache
def _explain_missing_dot_once() -> None:
    # Cached so a notebook that saves ten diagrams prints the explanation once, not ten times.
    print(MISSING_DOT_MESSAGE)


class Diagram:
    """DOT source that renders to SVG when graphviz's `dot` exists, and to its source otherwise.

    Args:
        source: a complete DOT graph (``digraph { ... }``).
    """

    def __init__(self, source: str) -> None:
        self.source = source

    def __str__(self) -> str:
        return self.source

    def __repr__(self) -> str:
        return f"Diagram({len(self.source.splitlines())} lines of DOT)"

    def svg(self) -> str | None:
        """The rendered SVG text, or None when `dot` is missing."""
        if not has_dot():
            return None
        try:
            return graphviz.Source(self.source).pipe(format="svg").decode("utf-8")
        except graphviz.ExecutableNotFound:
            # `shutil.which` and the graphviz package may disagree about PATH; missing is missing.
            return None

    def _repr_mimebundle_(
        self, include: Container[str] | None = None, exclude: Container[str] | None = None
    ) -> dict[str, str]:
        """Jupyter display: the SVG, or a one-line note plus the DOT source when `dot` is missing."""
        svg = self.svg()
        if svg is not None:
            bundle = {"image/svg+xml": svg, "text/plain": repr(self)}
        else:
            bundle = {
                "text/plain": f"{MISSING_DOT_MESSAGE}\n\n{self.source}",
                "text/markdown": f"{MISSING_DOT_MESSAGE}\n\n```dot\n{self.source}\n```",
            }
        # Jupyter may ask for a subset of mime types; honour it when it does.
        if include:
            bundle = {k: v for k, v in bundle.items() if k in include}
        if exclude:
            bundle = {k: v for k, v in bundle.items() if k not in exclude}
        return bundle

    def save(self, path: str | os.PathLike) -> pathlib.Path:
        """Write ``<path>.svg`` (or ``<path>.dot`` when `dot` is missing); returns the file written.

        Args:
            path: target without suffix (a ``.svg`` or ``.dot`` suffix is replaced).
        """
        path = pathlib.Path(path)
        if path.suffix in (".svg", ".dot"):
            path = path.with_suffix("")
        path.parent.mkdir(parents=True, exist_ok=True)
        svg = self.svg()
        if svg is not None:
            out = path.with_name(path.name + ".svg")
            write_file(out, svg)
        else:
            _explain_missing_dot_once()
            out = path.with_name(path.name + ".dot")
            write_file(out, self.source)
        return out
