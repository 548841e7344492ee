"""Charts as inline SVG drawn on the server (no JavaScript library, no network): each function
returns one escaped `<svg>` element sized in CSS pixels."""

from __future__ import annotations

import html
import math
from typing import Mapping, Optional, Sequence

# Colour-blind-safe (Okabe-Ito) series colours.
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442",
           "#000000")


def _fmt(value: float) -> str:
  if value == 0 or 1e-3 <= abs(value) < 1e4:
    return f"{value:.4g}"
  return f"{value:.2e}"


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
  if not math.isfinite(low) or not math.isfinite(high) or high <= low:
    return [low]
  step = (high - low) / count
  magnitude = 10 ** math.floor(math.log10(step))
  step = min((m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= step),
             default=step)
  first = math.ceil(low / step) * step
  return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def line_chart(series: Mapping[str, Sequence[tuple[float, float]]], *, title: str = "",
               x_label: str = "", y_label: str = "", width: int = 420, height: int = 240,
               square: Optional[tuple[float, float]] = None, diagonal: bool = False,
               markers: bool = False) -> str:
  """Lines, one per series of (x, y) points, with axes, ticks and a legend.

  Args:
    series: {name: points}; points with a non-finite value are left out.
    title, x_label, y_label: Drawn above the plot, under the x axis, beside the y axis.
    width, height: Pixels (the legend adds to the height).
    square: Fixed (low, high) of both axes (ROC curves: (0, 1)); default: the data's range.
    diagonal: Draw the y = x line (a ROC curve's chance level).
    markers: A dot at every point (short series).
  """
  clean = {name: finite for name, points in series.items()
           if (finite := [(float(x), float(y)) for x, y in points
                          if math.isfinite(float(x)) and math.isfinite(float(y))])}
  left, right, top, bottom = 52, 10, 24 if title else 8, 34
  plot_w, plot_h = width - left - right, height - top - bottom
  height += 14 * len(clean)  # The legend.
  out = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
         f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
         f'aria-label="{html.escape(title or y_label)}">']
  if title:
    out.append(f'<text x="{width / 2}" y="15" text-anchor="middle" class="title">'
               f'{html.escape(title)}</text>')
  if not clean:
    out.append(f'<text x="{width / 2}" y="{top + plot_h / 2}" text-anchor="middle">'
               'no points</text></svg>')
    return "".join(out)
  xs = [x for pts in clean.values() for x, _ in pts]
  ys = [y for pts in clean.values() for _, y in pts]
  if square:
    x0, x1 = y0, y1 = square
  else:
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x1 == x0:
      x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
      y0, y1 = y0 - abs(y0 or 1) * 0.1, y1 + abs(y1 or 1) * 0.1
    pad = 0.05 * (y1 - y0)
    y0, y1 = y0 - pad, y1 + pad

  def px(x: float) -> float:
    return left + (x - x0) / (x1 - x0) * plot_w

  def py(y: float) -> float:
    return top + plot_h - (y - y0) / (y1 - y0) * plot_h

  out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" class="frame"/>')
  for tick in _ticks(y0, y1):
    out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py(tick):.1f}" '
               f'y2="{py(tick):.1f}" class="grid"/><text x="{left - 4}" y="{py(tick) + 4:.1f}" '
               f'text-anchor="end">{_fmt(tick)}</text>')
  for tick in _ticks(x0, x1):
    out.append(f'<text x="{px(tick):.1f}" y="{top + plot_h + 14}" text-anchor="middle">'
               f'{_fmt(tick)}</text>')
  if x_label:
    out.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h + 28}" text-anchor="middle">'
               f'{html.escape(x_label)}</text>')
  if y_label:
    out.append(f'<text x="12" y="{top + plot_h / 2}" text-anchor="middle" '
               f'transform="rotate(-90 12 {top + plot_h / 2})">{html.escape(y_label)}</text>')
  if diagonal:
    out.append(f'<line x1="{px(x0)}" y1="{py(y0)}" x2="{px(x1)}" y2="{py(y1)}" '
               f'class="chance"/>')
  for i, (name, points) in enumerate(clean.items()):
    colour = COLOURS[i % len(COLOURS)]
    path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(points))
    out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.8" points="{path}" '
               f'data-series="{html.escape(name)}"/>')
    if markers or len(points) == 1:
      out.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{colour}">'
                 f'<title>{html.escape(name)}: {_fmt(x)}, {_fmt(y)}</title></circle>'
                 for x, y in points)
    legend_y = top + plot_h + 44 + 14 * i
    out.append(f'<rect x="{left}" y="{legend_y - 8}" width="10" height="3" fill="{colour}"/>'
               f'<text x="{left + 14}" y="{legend_y - 3}">{html.escape(name)}</text>')
  out.append("</svg>")
  return "".join(out)


def distribution_bars(probabilities: Sequence[float], labels: Sequence[str], *,
                      width: int = 150) -> str:
  """Horizontal bars of one probability distribution (a judge's bad/ok/good)."""
  row = 14
  out = [f'<svg class="bars" xmlns="http://www.w3.org/2000/svg" width="{width}" '
         f'height="{row * len(labels)}">']
  for i, (label, p) in enumerate(zip(labels, probabilities, strict=True)):
    p = float(p) if math.isfinite(float(p)) else 0.0
    bar = max(0.0, min(1.0, p)) * (width - 80)
    out.append(f'<text x="0" y="{row * i + 10}">{html.escape(label)}</text>'
               f'<rect x="34" y="{row * i + 2}" width="{bar:.1f}" height="{row - 4}" '
               f'fill="{COLOURS[i % len(COLOURS)]}"/>'
               f'<text x="{38 + bar:.1f}" y="{row * i + 10}" class="value">{p:.3f}</text>')
  out.append("</svg>")
  return "".join(out)


def interval(estimate: float, low: float, high: float, *, lo: float, hi: float,
             null: Optional[float] = None, width: int = 160) -> str:
  """One estimate with its interval on a shared axis [lo, hi] (a results table's column)."""
  if not all(math.isfinite(v) for v in (estimate, low, high, lo, hi)) or hi <= lo:
    return ""
  scale = lambda v: 4 + (min(max(v, lo), hi) - lo) / (hi - lo) * (width - 8)  # noqa: E731
  out = [f'<svg class="interval" xmlns="http://www.w3.org/2000/svg" width="{width}" height="14">']
  if null is not None and lo <= null <= hi:
    out.append(f'<line x1="{scale(null):.1f}" x2="{scale(null):.1f}" y1="0" y2="14" '
               'class="chance"/>')
  out.append(f'<line x1="{scale(low):.1f}" x2="{scale(high):.1f}" y1="7" y2="7" '
             f'stroke="{COLOURS[0]}" stroke-width="2"/><circle cx="{scale(estimate):.1f}" '
             f'cy="7" r="3" fill="{COLOURS[1]}"/></svg>')
  return "".join(out)
