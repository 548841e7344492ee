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
  """Lays `fig` out, writes it to `path` (making its folder), closes it and returns `path`."""
  from jaxmoral import fileio  # pylint: disable=g-import-not-at-top
  path = os.fspath(path)
  fileio.makedirs(os.path.dirname(fileio.abspath(path)))
  fig.tight_layout()
  with fileio.open(path, "wb") as f:  # A bucket object is uploaded whole on close.
    fig.savefig(f, dpi=dpi, format=os.path.splitext(path)[1][1:] or "png")
  pyplot().close(fig)
  return path
