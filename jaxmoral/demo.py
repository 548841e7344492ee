"""`jaxmoral demo` / `make demo`: every method end to end on bundled sample data, on CPU.

Each part trains tiny models from scratch, prints its metrics and sample outputs, and says
where its checkpoints, TensorBoard logs and pictures went. Nothing is downloaded.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import shutil
import sys
import sysconfig
import textwrap
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from jaxmoral import decoding
from jaxmoral import metrics
from jaxmoral import optimizers
from jaxmoral import partitioning
from jaxmoral import run_dirs
from jaxmoral import runs
from jaxmoral.models import config as config_lib
from jaxmoral.models import trainable

PARTS = ("core", "npov", "diamante", "clarify")

# -- what the papers found, and whether a demo run agrees ------------------------------------
# Each method's demo returns `truth_line`s; its experiment tests the claim at a scale that can
# show it (the demo's tiny models mostly cannot), and what it found lives in its result files.

FIDELITY_RESULTS = ("bench/RESULTS.md, \"Fidelity experiments\" (reports in "
                    "experiments/results/)")
EXPERIMENTS = {"clarify": "python experiments/clarify_table4.py",
               "npov": "python experiments/npov_table1.py",
               "diamante": "python experiments/diamante_fig3.py"}
VERDICTS = ("agrees", "disagrees", "cannot tell")


def interval_verdict(low: float, high: float, *, null: float = 0.0) -> str:
  """"agrees" when a 95 % interval lies above `null` (the paper's side), "disagrees" below,
  "cannot tell" when it holds `null`."""
  return "agrees" if low > null else "disagrees" if high < null else "cannot tell"


def _all_agree(verdicts: Sequence[str]) -> str:
  """"agrees" if every verdict does, else "disagrees" if any does, else "cannot tell"."""
  if all(v == "agrees" for v in verdicts):
    return "agrees"
  return "disagrees" if "disagrees" in verdicts else "cannot tell"


def _interval(ci: Any, digits: int = 3) -> str:
  return f"{ci.estimate:+.{digits}f} [{ci.low:+.{digits}f}, {ci.high:+.{digits}f}]"


def truth_line(*, method: str, paper: str, this_run: str, verdict: str) -> str:
  """Two lines: the `paper`'s claim (and where it makes it); `this_run`'s numbers with their
  95 % interval, the `verdict` from it (`interval_verdict`), and `method`'s experiment."""
  if verdict not in VERDICTS:
    raise ValueError(f"truth_line: verdict must be one of {VERDICTS}, got {verdict!r}")
  where = f"tested at scale by `{EXPERIMENTS[method]}`"
  text = {"agrees": f"agrees (the 95 % interval is on the paper's side; {where})",
          "disagrees": f"disagrees (the 95 % interval is on the other side, at the demo's "
                       f"tiny scale; {where})",
          "cannot tell": f"cannot tell (the 95 % interval holds no effect: too few examples "
                         f"at the demo's scale; {where})"}[verdict]
  return f"paper: {paper}\n  this run: {this_run} — {text}"


def clarify_truth_lines(evaluation: Mapping[str, Mapping[str, Any]]) -> list[str]:
  """ClarifyDelphi (Pyatkin et al. 2023, Table 4): PPO over the supervised generator, by the
  paired bootstrap interval over situations (`clarify.evaluate.compare`'s `per_situation`)."""
  if "ppo" not in evaluation or "finetuned" not in evaluation:
    return []
  ppo, sft = evaluation["ppo"]["per_situation"], evaluation["finetuned"]["per_situation"]
  lines = []
  for key, paper, fmt, digits in (
      ("jsd", "PPO raises the average JSD of the judge's verdicts over the supervised question "
              "generator (Table 4)", "avg JSD PPO {a:.3f} vs SFT {b:.3f}", 3),
      ("flips_pct", "PPO raises the % of judgment flips over the supervised generator (Table 4)",
       "flips PPO {a:.1f} % vs SFT {b:.1f} %", 1)):
    a, b = (np.asarray(x[key], np.float64) for x in (ppo, sft))
    diff = metrics.bootstrap_ci(np.mean, a - b)
    lines.append(truth_line(
        method="clarify", paper=paper,
        this_run=(fmt.format(a=a.mean(), b=b.mean()) + f", paired difference "
                  f"{_interval(diff, digits)} over {len(a)} situations"),
        verdict=interval_verdict(diff.low, diff.high)))
  return lines


NPOV_PAPER = {  # Chang et al. 2024, Table 1, synthetic slices (unparaphrased / paraphrased)
    "rouge": "ROUGE-1 overlap detects hallucinated and missing arguments above chance "
             "(ROC AUC hallucination .772 / .680, coverage .890 / .746)",
    "salience": "gradient x input salience detects both error types above chance "
                "(hallucination .736 / .708, coverage .875 / .831)",
    "classifier": "the prompt-tuned YES/NO classifiers detect both error types above chance "
                  "(hallucination .998 / .977, coverage .986 / .993)"}


def npov_truth_lines(results: Mapping[str, Any],
                     slices: Optional[Mapping[str, Sequence[Any]]] = None, *,
                     num_resamples: int = 1000) -> list[str]:
  """NPOV (Chang et al. 2024, Table 1): each detector's example-level ROC AUC per error type,
  the test slices of `npov.evaluate.evaluate_detectors`' results pooled, with its bootstrap
  interval against 0.5 and, given the slices' examples, the paired interval of its AUC minus
  the input length's (a synthetic error's length null). "agrees" needs both; the model-based
  detectors' untrained-model null only the experiment measures ("cannot tell" at best)."""
  from jaxmoral.npov import evaluate  # pylint: disable=import-outside-toplevel
  lines = []
  by_slice = list(results.values())
  pooled = " and ".join(results)
  lengths = None if slices is None else [
      evaluate.evaluate_slice(slices[name], evaluate.input_length_detections(slices[name]))
      for name in results]
  for detector, paper in NPOV_PAPER.items():
    if not by_slice or any(detector not in s for s in by_slice):
      continue
    found, verdicts = [], []
    for error in ("hallucination", "coverage"):
      labels = np.concatenate([np.asarray(s[detector][error]["labels"], np.int32)
                               for s in by_slice])
      scores = np.concatenate([np.asarray(s[detector][error]["scores"], np.float64)
                               for s in by_slice])
      if len(set(labels.tolist())) < 2:
        continue
      auc = metrics.bootstrap_ci(metrics.roc_auc_rows, labels, scores,
                                 num_resamples=num_resamples, vectorized=True)
      text = (f"{error} {auc.estimate:.3f} [{auc.low:.3f}, {auc.high:.3f}] "
              f"({len(labels)} examples")
      verdicts.append(interval_verdict(auc.low, auc.high, null=0.5))
      if lengths is None:
        verdicts.append("cannot tell")
        text += "; input-length null not measured)"
      else:
        length = np.concatenate([np.asarray(s[error]["scores"], np.float64) for s in lengths])
        diff = metrics.bootstrap_ci(metrics.roc_auc_difference_rows, labels, scores, length,
                                    num_resamples=num_resamples, vectorized=True)
        verdicts.append(interval_verdict(diff.low, diff.high))
        text += f"; minus the input length's {_interval(diff)})"
      found.append(text)
    if len(found) < 2:
      continue
    if detector != "rouge":
      verdicts.append("cannot tell")  # The untrained-model null: the experiment's.
    lines.append(truth_line(
        method="npov", paper=f"{paper} (Table 1)",
        this_run=f"ROC AUC {', '.join(found)} (example level, the {pooled} test slices "
                 "pooled; the table shows each"
                 + ("" if detector == "rouge" else "; the untrained-model null is the "
                    "experiment's") + ")",
        verdict=_all_agree(verdicts)))
  return lines


def diamante_truth_lines(per_context: Mapping[str, Any]) -> list[str]:
  """Diamante (Lu, Bao et al. 2023, Fig. 3): the preference score ranks the human response
  first more often than chance and than the better generation-probability ranker, by paired
  intervals over contexts (`diamante.evaluate.rank_contexts`' arrays). "agrees" needs both;
  whether joint training is what makes the score work only the experiment tests."""
  p1 = {r: np.asarray(per_context[f"{r}/p@1"], np.float64)
        for r in ("preference", "generation", "generation_per_token", "random")}
  rival = max(("generation", "generation_per_token"), key=lambda r: p1[r].mean())
  over_chance = metrics.bootstrap_ci(np.mean, p1["preference"] - p1["random"])
  over_rival = metrics.bootstrap_ci(np.mean, p1["preference"] - p1[rival])
  return [truth_line(
      method="diamante",
      paper="ranked by the jointly trained preference score, the human response comes first "
            "far more often than by chance and than ranked by generation probability (Fig. 3)",
      this_run=(f"P@1 {p1['preference'].mean():.3f} by preference vs "
                f"{p1['random'].mean():.3f} by chance, {p1['generation'].mean():.3f} by "
                f"log-prob, {p1['generation_per_token'].mean():.3f} per token; preference "
                f"minus chance {_interval(over_chance)}, minus "
                f"{rival.replace('_', ' ')} {_interval(over_rival)} over "
                f"{len(p1['preference'])} contexts"),
      verdict=_all_agree([interval_verdict(d.low, d.high) for d in (over_chance, over_rival)]))]


def _banner(text: str) -> None:
  print("\n" + "=" * 78 + f"\n{text}\n" + "=" * 78, flush=True)


def run_core_demo(*, workdir: str | os.PathLike[str]) -> dict[str, Any]:
  """The T5X-style core: train a tiny T5 1.1 on the demo mixture, evaluate, infer, export."""
  workdir = pathlib.Path(workdir)
  model_dir = workdir / "run"
  steps = 200
  data = runs.Seq2SeqData(mixture_or_task_name="jaxmoral_demo_clarify")
  lengths = {"inputs": 48, "targets": 24}
  metrics = runs.train_run(
      model_dir=str(model_dir),
      model=trainable.Seq2SeqModel(config=config_lib.t5_config(size="tiny")), data=data,
      train_steps=steps, batch_size=32, feature_lengths=lengths,
      optimizer=optimizers.make_optimizer(
          name="adamw", learning_rate=optimizers.make_schedule(
              name="warmup_linear_decay", base_learning_rate=3e-3, warmup_steps=20,
              total_steps=steps), grad_clip_norm=1.0),
      partitioner=partitioning.PjitPartitioner(), eval_every=100, checkpoint_every=100,
      log_every=50)
  report = runs.eval_run(model_dir=str(model_dir), data=data, feature_lengths=lengths,
                         decode_examples=3)
  inputs = workdir / "infer_inputs.txt"
  inputs.write_text("question: lying to a friend to protect their feelings\n"
                    "SITUATION: skipping a family dinner. QUESTION: Why did you skip it? "
                    "ANSWER: I was sick\n")
  runs.infer_run(model_dir=str(model_dir), input_file=str(inputs),
                 output_file=str(workdir / "predictions.jsonl"),
                 sample_config=decoding.SampleConfig(max_decode_length=24, greedy=True))
  runs.export_run(model_dir=str(model_dir), output_dir=str(workdir / "exported"),
                  dtype="bfloat16", overwrite=True)
  return {"eval": report["metrics"], "final_train_loss": metrics.get("train/loss"),
          "checkpoints": run_dirs.checkpoints_dir(model_dir),
          "tensorboard": str(model_dir), "predictions": str(workdir / "predictions.jsonl"),
          "export": str(workdir / "exported")}


def _method_demo(part: str) -> Callable[..., dict[str, Any]]:
  if part == "core":
    return run_core_demo
  return importlib.import_module(f"jaxmoral.{part}.demo").run_demo


def run_all(*, workdir: str | os.PathLike[str] = "demo_out",
            only: Optional[Sequence[str]] = None) -> dict[str, Any]:
  """Runs the demos of `PARTS` (or `only` those) in order, one sub-folder of `workdir` each,
  writes `workdir/summary.json` and returns it: each part's metrics, output paths and wall time."""
  parts = tuple(only) if only else PARTS
  unknown = sorted(set(parts) - set(PARTS))
  if unknown:
    raise ValueError(f"demo: unknown part(s) {unknown}; known: {list(PARTS)}")
  workdir = pathlib.Path(workdir).resolve()
  workdir.mkdir(parents=True, exist_ok=True)
  summary: dict[str, Any] = {}
  start = time.time()
  for part in parts:
    _banner(f"jaxmoral demo: {part}")
    begin = time.time()
    result = _method_demo(part)(workdir=workdir / part)
    # The part's own "seconds" (if any) gives way to the rounded wall time of the whole part.
    summary[part] = {**(result or {}), "seconds": round(time.time() - begin, 1)}
    print(f"\n[{part}] done in {summary[part]['seconds']} s")
  summary["total_seconds"] = round(time.time() - start, 1)
  (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
  _banner(f"demo finished in {summary['total_seconds']} s; summary: "
          f"{shown_path(workdir / 'summary.json')}")
  for part in parts:
    paths = {k: v for k, v in summary[part].items() if isinstance(v, str)}
    for index, (key, value) in enumerate(paths.items()):
      print(f"{part if index == 0 else '':9s} {key:12s} {shown_path(value)}")
  truths = [(part, line) for part in parts for line in summary[part].get("truth", [])]
  if truths:
    print("\nWhat the papers found, and whether this demo agrees:")
    for part, line in truths:
      for number, text in enumerate(f"[{part}] {line}".splitlines()):
        print(textwrap.fill(text.strip(), WIDTH, initial_indent="  " * bool(number),
                            subsequent_indent="    "))
    print(textwrap.fill(f"What the experiments found at scale: {FIDELITY_RESULTS}.", WIDTH))
  folder = shown_path(workdir)
  print(f"\nEvery run's curves: {installed_command('tensorboard', 'tensorboard.main')} "
        f"--logdir {folder}")
  print(f"Look at the examples in a browser: {installed_command('jaxmoral', 'jaxmoral.cli')} "
        f"explore {folder}")
  return summary


WIDTH = 100  # Columns of the demo's printed lines.


def installed_command(name: str, module: str) -> str:
  """How a user's shell runs console script `name` of this process's environment: the bare
  name where it is the one on PATH, else its path (`.venv/bin/tensorboard`), else
  `python -m module`."""
  script = pathlib.Path(sysconfig.get_path("scripts")) / name
  if not script.is_file():
    return f"{sys.executable} -m {module}"
  on_path = shutil.which(name)
  if on_path is not None and pathlib.Path(on_path).resolve() == script.resolve():
    return name
  shown = shown_path(script)
  return shown if os.sep in shown else os.path.join(".", shown)


def shown_path(workdir: str | os.PathLike[str]) -> str:
  """A demo path as the user would type it: relative to where they are, when inside."""
  path, here = pathlib.Path(workdir), pathlib.Path.cwd()
  return str(path.relative_to(here)) if path.is_relative_to(here) else str(workdir)
