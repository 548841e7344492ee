"""Salience heatmaps (HTML) and ROC curves (PNG) for the NPOV detectors."""

from __future__ import annotations

import html
import os
from typing import Any, Mapping, Optional

import numpy as np

from jaxmoral import fileio, metrics, pictures
from jaxmoral.npov.detectors import base


def _cell(value: float, vmax: float) -> str:
  shade = int(255 - 200 * min(1.0, value / vmax)) if vmax > 0 else 255
  return f'<td style="background:rgb({shade},{shade},255)" title="{value:.4f}"></td>'


def salience_heatmap_html(word_map: Any, detection: base.Detection, path: str | os.PathLike, *,
                          title: str = "", suspect_threshold: float = 0.5) -> str:
  """Writes an HTML heatmap: input words (rows) x response words (columns).

  Response words whose hallucination score and argument words whose coverage score exceed
  `suspect_threshold` are highlighted in red.
  """
  matrix = np.asarray(word_map.matrix)
  vmax = float(matrix.max()) if matrix.size else 1.0
  response_scores = [w.score for w in detection.response_words]
  argument_scores = {(w.field, w.index, w.start): w.score for w in detection.argument_words}
  def label(text: str, score: Optional[float]) -> str:
    style = ' style="color:#c00;font-weight:bold"' if score is not None and (
        score > suspect_threshold) else ""
    return f"<span{style}>{html.escape(text)}</span>"
  head = "".join(
      f'<th style="writing-mode:vertical-rl">{label(w.text, s)}</th>'
      for w, s in zip(word_map.response_words, response_scores + [None] * len(
          word_map.response_words)))
  rows = []
  for r, (field, index, w) in enumerate(word_map.input_words):
    score = argument_scores.get((field, index, w.start))
    cells = "".join(_cell(float(v), vmax) for v in matrix[r])
    rows.append(f"<tr><th>{html.escape(field)} {index + 1 if field in ('pro', 'con') else ''}"
                f"</th><th>{label(w.text, score)}</th>{cells}</tr>")
  doc = (f"<html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
         f"<h3>{html.escape(title)}</h3><p>hallucination score {detection.hallucination:.3f}, "
         f"coverage score {detection.coverage:.3f}; red = suspect word</p>"
         f"<table style='border-collapse:collapse;font:11px sans-serif'>"
         f"<tr><th></th><th></th>{head}</tr>{''.join(rows)}</table></body></html>")
  path = os.fspath(path)
  with fileio.open(path, "w", encoding="utf-8") as f:
    f.write(doc)
  return path


def roc_curves_png(by_detector: Mapping[str, Any], path: str | os.PathLike, *,
                   title: str = "") -> bool:
  """ROC curves (one panel per error type, one line per detector) from `evaluate_slice`
  results; returns False (and writes nothing) when no curve has both classes."""
  plt = pictures.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(9, 4))
  drawn = False
  for ax, error in zip(axes, ("hallucination", "coverage")):
    for name, result in by_detector.items():
      labels, scores = result[error]["labels"], result[error]["scores"]
      if len(set(labels)) < 2:
        continue
      fpr, tpr, _ = metrics.roc_curve(np.asarray(labels), np.asarray(scores))
      ax.plot(fpr, tpr, label=f"{name} ({100 * result[error]['example_auc']:.1f})")
      drawn = True
    ax.plot([0, 1], [0, 1], "k:", lw=0.8)
    ax.set_title(f"{title} {error}")
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.legend(loc="lower right", fontsize=8)
  if drawn:
    pictures.save_figure(fig, path)
  else:
    plt.close(fig)
  return drawn
