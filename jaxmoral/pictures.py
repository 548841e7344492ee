"""The pictures runs write (reward curves, ROC curves, result plots): matplotlib on its headless
backend, saved as PNG files beside the run's other outputs."""

from __future__ import annotations

import os
from typing import Any


def pyplot() -> Any:
  """`matplotlib.pyplot` on the Agg backend: a training host has no display, and a run writes
  pictures rather than opening windows."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def save_figure(fig: Any, path: str | os.PathLike[str], *, dpi: int = 100) -> str:
  """Lays `fig` out, writes it to `path` (making its folder) and closes it.

  Returns:
    The path written, as a string.
  """
  path = os.fspath(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  pyplot().close(fig)
  return path
