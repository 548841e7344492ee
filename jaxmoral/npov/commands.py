"""`jaxmoral npov <action>`: flags -> one library call (the lead's cli.py dispatches here).

Actions:
  detect    --input responses.jsonl --output scores.jsonl [--detector rouge|salience|classifier]
            [--base_dir D --vocabulary S.model --generator_dir P --hallucination_dir P
             --coverage_dir P --heatmap_dir H --roc_dir R]           -> detect.detect_file
  evaluate  gin-configured (`npov.evaluate.run`), e.g. --gin_file=configs/npov/eval_rouge_perspectrum.gin
  demo      [--workdir W]                                            -> demo.run_demo

`jaxmoral npov <action> --help` prints the action's usage without loading any model code;
what an action writes is checked to be writable before any work starts.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from jaxmoral import gin_utils

ACTIONS = ("detect", "evaluate", "demo")
HELP_FLAGS = ("-h", "--help")
# The gin-configured function of `evaluate` (flags: gin only).
EVALUATE = ("jaxmoral.npov.evaluate", "run")


def _detect_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jaxmoral npov detect",
                              description="Score hallucination / coverage errors of responses.")
  p.add_argument("--input", required=True, help="JSONL: query, pro, con, response [, labels]")
  p.add_argument("--output", required=True, help="JSONL scores (example and word level)")
  p.add_argument("--detector", default="rouge", choices=("rouge", "salience", "classifier"))
  p.add_argument("--base_dir", default=None, help="exported base model (salience, classifier)")
  p.add_argument("--vocabulary", default=None, help="SentencePiece model of the base model")
  p.add_argument("--generator_dir", default=None, help="generator prompt dir (salience)")
  p.add_argument("--hallucination_dir", default=None, help="classifier prompt dir")
  p.add_argument("--coverage_dir", default=None, help="classifier prompt dir")
  p.add_argument("--heatmap_dir", default=None, help="salience: write one HTML heatmap each")
  p.add_argument("--roc_dir", default=None, help="labelled input: ROC AUC table and curves")
  return p


def _demo_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jaxmoral npov demo",
                              description="Train and evaluate every NPOV detector on the "
                                          "bundled sample data.")
  p.add_argument("--workdir", default="demo_out/npov")
  return p


def main(action: str, rest: Sequence[str], gin_args: gin_utils.GinArgs) -> int:
  """Runs one action; returns the exit status."""
  if action not in ACTIONS:
    raise ValueError(f"npov: unknown action {action!r}; known: {list(ACTIONS)}")
  if action == "evaluate" and any(arg in HELP_FLAGS for arg in rest):
    print(gin_utils.function_usage(*EVALUATE, prog="jaxmoral npov evaluate", gin_only=True))
    return 0
  # Flags first (--help exits here), and what they name to write checked, before any
  # model code loads.
  args = None
  if action == "detect":
    args = _detect_parser().parse_args(list(rest))
    gin_utils.check_writable(args.output)
    for directory in (args.heatmap_dir, args.roc_dir):
      if directory:
        gin_utils.check_writable(directory, directory=True)
  elif action == "demo":
    args = _demo_parser().parse_args(list(rest))
    gin_utils.check_writable(args.workdir, directory=True)
  elif rest:
    raise ValueError(f"npov evaluate takes gin flags only, got {list(rest)}")
  # The action's modules first: their configurables must exist before gin binds them.
  # pylint: disable=g-import-not-at-top
  from jaxmoral.npov import demo, detect, evaluate
  from jaxmoral.npov.detectors import classifier, rouge, salience  # pylint: disable=unused-import
  # pylint: enable=g-import-not-at-top
  gin_utils.parse_gin(gin_args)
  if action == "detect":
    dirs: dict[str, Any] = {k: v for k, v in (("hallucination", args.hallucination_dir),
                                               ("coverage", args.coverage_dir)) if v}
    records = detect.detect_file(
        input_path=args.input, output_path=args.output, detector=args.detector,
        base_dir=args.base_dir, vocabulary_path=args.vocabulary,
        generator_dir=args.generator_dir, classifier_dirs=dirs or None,
        heatmap_dir=args.heatmap_dir, roc_dir=args.roc_dir)
    print(f"npov detect: scored {len(records)} responses -> {args.output}")
  elif action == "evaluate":
    gin_utils.check_required()
    output_dir = gin_utils.bound_value(".".join(EVALUATE), "output_dir")
    if isinstance(output_dir, str):
      gin_utils.check_writable(output_dir, directory=True)
    evaluate.run()  # pylint: disable=missing-kwoa
  else:
    demo.run_demo(workdir=args.workdir)
  return 0
