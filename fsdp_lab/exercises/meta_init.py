"""Exercises of the meta_init lab (being written)."""

from __future__ import annotations

from fsdp_lab.exercises.exercise import Exercise

EXERCISES: tuple[Exercise, ...] = ()
