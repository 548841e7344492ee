"""`jaxmoral demo` / `make demo`: every method end to end on bundled sample data, on CPU.

Each part trains tiny models from scratch (a demo SentencePiece vocabulary is built from the
bundled corpus), prints its metrics and sample outputs, and says where its checkpoints,
TensorBoard logs and pictures went. Nothing is downloaded.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import time
from typing import Any, Callable, Optional, Sequence

PARTS = ("core", "npov", "diamante", "clarify")


def _banner(text: str) -> None:
  print("\n" + "=" * 78 + f"\n{text}\n" + "=" * 78, flush=True)


def run_core_demo(*, workdir: str | os.PathLike[str]) -> dict[str, Any]:
  """The T5X-style core: train a tiny T5 1.1 on the demo mixture, evaluate, infer, export."""
  from jaxmoral import decoding
  from jaxmoral import optimizers
  from jaxmoral import partitioning
  from jaxmoral import runs
  from jaxmoral.models import config as config_lib
  from jaxmoral.models import trainable

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
          "checkpoints": str(model_dir / "checkpoints"),
          "tensorboard": str(model_dir), "predictions": str(workdir / "predictions.jsonl"),
          "export": str(workdir / "exported")}


def _method_demo(part: str) -> Callable[..., dict[str, Any]]:
  if part == "core":
    return run_core_demo
  return importlib.import_module(f"jaxmoral.{part}.demo").run_demo


def run_all(*, workdir: str | os.PathLike[str] = "demo_out",
            only: Optional[Sequence[str]] = None) -> dict[str, Any]:
  """Runs the demos in order and writes `workdir/summary.json`.

  Args:
    workdir: Output folder (one sub-folder per part).
    only: Subset of ("core", "npov", "diamante", "clarify").

  Returns:
    Each part's summary (metrics and output paths) and its wall time.
  """
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
  _banner(f"demo finished in {summary['total_seconds']} s; summary: {workdir / 'summary.json'}")
  for part in parts:
    paths = {k: v for k, v in summary[part].items() if isinstance(v, str)}
    print(f"{part:9s} " + "  ".join(f"{k}={v}" for k, v in paths.items()))
  return summary
