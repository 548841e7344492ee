"""Recomputes the verdicts of stored results by the current rule, without re-running.

Each experiment's `<name>.json` keeps the numbers its verdict needs (Diamante: every context's
ranks; NPOV: every interval; ClarifyDelphi: the paired differences). This reads them, applies
the experiment's verdict (`experiment_lib.claim_verdict` under each), and rewrites `<name>.json`
and the verdict lines of `<name>.md` in place; its tables and plot stay as the run wrote them.
From the project root:

  python experiments/reverdict.py experiments/results/*.json
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
from typing import Any, Sequence

import numpy as np

import experiment_lib  # noqa: F401  pylint: disable=unused-import  (the project root on sys.path)
import clarify_table4  # pylint: disable=g-import-not-at-top,wrong-import-order
import diamante_fig3  # pylint: disable=g-import-not-at-top,wrong-import-order
import npov_table1  # pylint: disable=g-import-not-at-top,wrong-import-order


def reverdict(results: dict[str, Any], *, name: str) -> tuple[dict[str, Any], Any]:
  """(results with the verdicts recomputed, the experiment's module); (results, None) for
  results that hold no verdict (e.g. the reward probe's)."""
  if name.startswith("diamante_fig3") and "per_context" in results:
    setup = results["setup"]
    per_context = {m: {k: np.asarray(v, np.float64) for k, v in pc.items()}
                   for m, pc in results["per_context"].items()}
    results.update(diamante_fig3.summarize(per_context, num_resamples=setup["num_resamples"],
                                           seed=setup["seed"]))
    return results, diamante_fig3
  if name.startswith("npov_table1") and "auc" in results:
    results["verdicts"] = npov_table1.verdicts(results["auc"], results.get("nulls"))
    results["ordering_verdicts"] = npov_table1.ordering_verdicts(results.get("ordering", {}),
                                                                 results.get("nulls"))
    return results, npov_table1
  if name.startswith("clarify_table4") and "differences" in results:
    results["verdict"], results["verdict_why"] = clarify_table4.verdict(results["differences"])
    results["diagnosis"] = clarify_table4.diagnosis(results)
    return results, clarify_table4
  return results, None


def splice(markdown: str, verdict_lines: Sequence[str]) -> str:
  """`markdown` (a report an older version wrote) with its verdict lines replaced: from the
  first "Claim:"/"Claims"/"- <detector>: paper:" line to the blank line before "Seconds:" or
  "Plot:" (or the end)."""
  lines = markdown.rstrip("\n").split("\n")
  start = next(i for i, line in enumerate(lines)
               if line.startswith(("Claim:", "Claims,")) or re.match(r"- \w+: paper: ", line))
  end = next((i for i in range(start, len(lines))
              if lines[i].startswith(("Seconds:", "Plot:"))), len(lines))
  while end > start and not lines[end - 1].strip():
    end -= 1
  return "\n".join([*lines[:start], *verdict_lines, *lines[end:]]) + "\n"


def main(paths: Sequence[str]) -> int:
  for path in paths:
    name = pathlib.Path(path).stem
    results, experiment = reverdict(
        json.loads(pathlib.Path(path).read_text(encoding="utf-8")), name=name)
    if experiment is None:
      continue
    # The tables stay as their run wrote them (older versions wrote other columns).
    md = pathlib.Path(os.path.splitext(path)[0] + ".md")
    md.write_text(splice(md.read_text(encoding="utf-8"), experiment.verdict_lines(results)),
                  encoding="utf-8")
    pathlib.Path(path).write_text(json.dumps(results, indent=2, sort_keys=True, default=str)
                                  + "\n", encoding="utf-8")
    verdict = results.get("verdict") or {
        **{d: {e: v["verdict"] for e, v in by.items()} for d, by in results["verdicts"].items()
           if d in npov_table1.PAPER_ORDER_DETECTORS},
        "ordering": {e: v["verdict"] for e, v in results["ordering_verdicts"].items()}}
    print(f"{md}: {verdict}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
