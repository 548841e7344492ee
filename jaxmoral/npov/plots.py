"""Salience heatmaps (HTML) and ROC curves (PNG) for the NPOV detectors."""

from __future__ import annotations

import dataclasses
import html
import os
from typing import Any, Mapping, Sequence

import numpy as np

from jaxmoral import fileio
from jaxmoral import metrics
from jaxmoral import pictures
from jaxmoral.npov.detectors import base

# A word is flagged (bold, underlined) when its score is this many standard deviations above
# the mean of its kind in the example: salience scores are relative (most response words of a
# short model score above 0.5), so no fixed value picks the words that stand out.
SUSPECT_Z = 1.0


def _colour(score: float, vmax: float) -> str:
  """White (0) to red (vmax): the heatmap's one scale."""
  fraction = min(1.0, max(0.0, score / vmax)) if vmax > 0 else 0.0
  other = int(round(255 - 200 * fraction))
  return f"rgb(255,{other},{other})"


def suspect_cutoff(scores: Any) -> float:
  """The score above which a word is flagged: mean + `SUSPECT_Z` standard deviations (inf for
  fewer than two words: nothing stands out of one)."""
  scores = np.asarray(scores, np.float64)
  if scores.size < 2:
    return float("inf")
  return float(scores.mean() + SUSPECT_Z * scores.std())


@dataclasses.dataclass(frozen=True)
class WordShading:
  """How one example's word scores are drawn, in the heatmap and in `jaxmoral explore`: `vmax`
  (the highest word score, drawn darkest; response and arguments share one scale) and the
  cutoffs above which response and argument words are flagged (`suspect_cutoff`)."""
  vmax: float
  response_cutoff: float
  argument_cutoff: float


def word_shading(response_scores: Sequence[float], argument_scores: Sequence[float]) -> WordShading:
  """One example's scale and flagging thresholds (see `WordShading`)."""
  scores = [*response_scores, *argument_scores]
  return WordShading(vmax=max(scores) if scores else 1.0,
                     response_cutoff=suspect_cutoff(response_scores),
                     argument_cutoff=suspect_cutoff(argument_scores))


def _cell(value: float, vmax: float) -> str:
  return (f'<td style="background:{_colour(value, vmax)};min-width:14px;text-align:center" '
          f'title="{value:.4f}">{value:.1f}</td>')


def salience_heatmap_html(word_map: Any, detection: base.Detection, path: str | os.PathLike, *,
                          example: Any, title: str = "") -> str:
  """Writes an HTML page that reads at a glance.

  On top, the response (by hallucination score) and the input arguments (by coverage score),
  each scored word coloured in place on one white-to-red scale, flagged words in bold
  (`suspect_cutoff`); below, folded, the input x response word salience matrix.

  `word_map` and `detection` are the salience detector's of `example`.
  """
  response_words, argument_words = detection.response_words, detection.argument_words
  shading = word_shading([w.score for w in response_words], [w.score for w in argument_words])
  vmax, response_cutoff = shading.vmax, shading.response_cutoff

  def block(field: str, index: int, words: Sequence[Any], cutoff: float) -> str:
    """The field's text, each scored word coloured in place by its score (title: the value)."""
    text = example.response if field == "response" else getattr(example, field)[index]
    out, position = [], 0
    for w in sorted(words, key=lambda w: w.start):
      out.append(html.escape(text[position:w.start]))
      flag = ";font-weight:bold;text-decoration:underline" if w.score > cutoff else ""
      out.append(f'<span style="background:{_colour(w.score, vmax)}{flag}" '
                 f'title="{w.score:.3f}">{html.escape(text[w.start:w.end])}</span>')
      position = w.end
    out.append(html.escape(text[position:]))
    return "".join(out)

  flagged = sum(w.score > response_cutoff for w in response_words)
  parts = [f"<h4>Response: hallucination score {detection.hallucination:.3f} "
           f"({flagged} of {len(response_words)} words flagged)</h4>",
           f"<p>{block('response', 0, response_words, response_cutoff)}</p>",
           f"<h4>Arguments: coverage score {detection.coverage:.3f}</h4><ul>"]
  arguments: dict[tuple[str, int], list] = {}
  for w in argument_words:
    arguments.setdefault((w.field, w.index), []).append(w)
  for (field, index), words in sorted(arguments.items()):
    parts.append(f"<li><b>{html.escape(field)} {index + 1}</b>: "
                 f"{block(field, index, words, shading.argument_cutoff)}</li>")
  parts.append("</ul>")
  legend = "".join(f'<span style="background:{_colour(v, vmax)};padding:2px 8px">{v:.2f}'
                   f"</span>" for v in np.linspace(0.0, vmax, 5))
  matrix = np.asarray(word_map.matrix)
  mmax = float(matrix.max()) if matrix.size else 1.0
  head = "".join(f'<th style="writing-mode:vertical-rl">{html.escape(w.text)}</th>'
                 for w in word_map.response_words)
  rows = [f"<tr><th>{html.escape(field)} {index + 1 if field in ('pro', 'con') else ''}</th>"
          f"<th>{html.escape(w.text)}</th>{''.join(_cell(float(v), mmax) for v in matrix[r])}"
          f"</tr>" for r, (field, index, w) in enumerate(word_map.input_words)]
  doc = (f"<html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
         f"<body style='font:14px sans-serif;max-width:60em'><h3>{html.escape(title)}</h3>"
         f"<p>Scale (word error score): {legend}. <b><u>Flagged</u></b>: more than {SUSPECT_Z:g} "
         f"standard deviation(s) above the mean of its kind in this example.</p>"
         f"{''.join(parts)}<details><summary>Input x response word salience (0 to "
         f"{mmax:.2f})</summary><table style='border-collapse:collapse;font:10px sans-serif'>"
         f"<tr><th></th><th></th>{head}</tr>{''.join(rows)}</table></details></body></html>")
  fileio.write_text(path, doc)
  return os.fspath(path)


def roc_curves_png(by_detector: Mapping[str, Any], path: str | os.PathLike, *,
                   title: str = "") -> bool:
  """ROC curves (one panel per error type, one line per detector) from `evaluate_slice`
  results; returns False (and writes nothing) when no curve has both classes."""
  plt = pictures.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(9, 4))
  drawn = False
  for ax, error in zip(axes, base.ERRORS, strict=True):
    curves = 0
    for name, result in by_detector.items():
      labels, scores = result[error]["labels"], result[error]["scores"]
      if len(set(labels)) < 2:
        continue
      fpr, tpr, _ = metrics.roc_curve(np.asarray(labels), np.asarray(scores))
      ax.plot(fpr, tpr, label=f"{name} ({100 * result[error]['example_auc']:.1f})")
      curves += 1
    ax.plot([0, 1], [0, 1], "k:", lw=0.8)
    ax.set(title=f"{title} {error}", xlabel="false positive rate", ylabel="true positive rate")
    if curves:
      ax.legend(loc="lower right", fontsize=8)
    else:  # Say why the panel is empty rather than leave a bare diagonal.
      ax.text(0.5, 0.5, "no examples of both classes", ha="center", va="center",
              transform=ax.transAxes)
    drawn = drawn or curves > 0
  if drawn:
    pictures.save_figure(fig, path)
  else:
    plt.close(fig)
  return drawn
