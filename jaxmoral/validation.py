"""Argument checks shared by the configs' `__post_init__` and the entry functions."""

from __future__ import annotations

from typing import Any


def positive_int(value: Any, name: str) -> None:
  """Raises a ValueError naming `name` (e.g. "T5Config.d_model") unless `value` is an int > 0
  (a bool is not one)."""
  if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


def non_negative_int(value: Any, name: str) -> None:
  """`positive_int`, for an int >= 0."""
  if not isinstance(value, int) or isinstance(value, bool) or value < 0:
    raise ValueError(f"{name} must be an int >= 0, got {value!r}")
