"""One module per lab; each has ``run(...) -> LabResult`` and is what the notebook, the CLI
(`fsdp-lab <lab>`) and the tests call, so all three show the same measured numbers.

Beside each, ``<lab>_config.py`` holds its frozen config and command-line options without
importing torch, so that ``fsdp-lab --help`` answers at once; the lab module re-exports it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LabResult:
    """Everything a lab measured, as plain JSON-serialisable data.

    Args:
        lab: the lab's CLI name ("collectives", "shard", ...).
        data: the measured figures, per-rank traces and tables (JSON types only).
    """

    lab: str
    data: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def to_dict(self) -> dict[str, Any]:
        return {"lab": self.lab, **self.data}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LabResult:
        d = dict(d)
        return cls(d.pop("lab"), d)
