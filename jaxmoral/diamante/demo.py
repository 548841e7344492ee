"""`jaxmoral diamante demo`: a tiny joint model from scratch on the bundled dialogues (CPU).

Trains a tiny T5 with NLL + PE on the bundled training dialogues (as
configs/diamante/tiny_cpu.gin does), evaluates the ranking of human responses on the held-out
ones, and prints a few reranked replies and a short self-chat. Under two minutes on a CPU.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from typing import Any, TextIO

import gin
import jax

from jaxmoral import demo as demo_lib
from jaxmoral import fileio
from jaxmoral import optimizers
from jaxmoral import partitioning
from jaxmoral import runs
from jaxmoral.data import demo as demo_data
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.diamante import bundle as bundle_lib
from jaxmoral.diamante import chat
from jaxmoral.diamante import data
from jaxmoral.diamante import diamante_model
from jaxmoral.diamante import evaluate
from jaxmoral.diamante import inference
from jaxmoral.models.config import t5_config


def _candidates_note(reply: inference.Reply) -> str:
  """What the reply was chosen from: its score, and the lowest-scored different candidate
  (none when every candidate is the reply's text)."""
  others = [c for c in reply.candidates if c.text != reply.text]
  note = f"score {reply.score:.2f}, best of {len(reply.candidates)} candidates"
  if not others:
    return note + ", all the same text"
  distinct = len({c.text for c in reply.candidates})
  worst = min(others, key=lambda c: c.score)
  return f"{note} ({distinct} different); lowest {worst.score:.2f}: {worst.text}"


@gin.configurable
def run_demo(*, workdir: str, train_steps: int = 200, batch_size: int = 16, seed: int = 0,
             output: TextIO = sys.stdout) -> dict[str, Any]:
  """Trains, evaluates and chats with a tiny Diamante model.

  Args:
    workdir: Output folder (run, export, transcripts, metrics).
    batch_size: Quadruples per step.
    seed: Everything random.

  Returns:
    `{"train": ..., "eval": ..., "model_dir": ..., "tensorboard": ..., "transcript": ...}`.
  """
  train_turns = data.read_dialogues(demo_data.path("dialogues_train.jsonl"))
  test_turns = data.read_dialogues(demo_data.path("dialogues_test.jsonl"))
  train_path, test_path = (os.path.join(workdir, f"{name}.jsonl") for name in ("train", "test"))
  data.write_turns(train_path, train_turns)
  data.write_turns(test_path, test_turns)
  vocab_path = vocab_lib.build_demo_vocabulary(output_dir=os.path.join(workdir, "vocab"))
  model_dir = os.path.join(workdir, "diamante_run")
  # The core run, as `jaxmoral diamante train --gin_file=configs/diamante/tiny_cpu.gin` does.
  train = runs.train_run(
      model_dir=model_dir, model=diamante_model.DiamanteModel(config=t5_config(size="tiny")),
      data=data.DialogueData(train_path=train_path, eval_path=test_path, vocab_path=vocab_path),
      train_steps=train_steps, batch_size=batch_size, feature_lengths={"inputs": 64, "targets": 24},
      optimizer=optimizers.make_optimizer(name="adamw", learning_rate=2e-3),
      partitioner=partitioning.PjitPartitioner(), seed=seed,
      log_every=max(1, train_steps // 5), checkpoint_every=train_steps)
  bundle = bundle_lib.load(model_dir)
  rerank = inference.RerankConfig(num_candidates=8, max_decode_length=24)
  # Per context, for the paired interval of the truth line; then its means.
  rankings: list = []
  per_context = evaluate.rank_contexts(bundle, test_turns, num_random=3, max_candidates=5,
                                       seed=seed, rankings=rankings)
  metrics = evaluate.ranking_summary(per_context)
  metrics.update(evaluate.generation_metrics(
      bundle, [test_turns[int(i)].context for i in per_context["turn"][:8]], rerank=rerank,
      seed=seed))
  print("\n== Diamante demo: held-out ranking of the human response ==", file=output)
  print(f"contexts: {int(metrics['num_contexts'])}   random-ranker P@1: "
        f"{metrics['random/p@1']:.3f}", file=output)
  for name in ("preference", "generation", "generation_per_token"):
    print(f"  by {name:<22} MAP {metrics[name + '/map']:.3f}  MRR {metrics[name + '/mrr']:.3f}"
          f"  P@1 {metrics[name + '/p@1']:.3f}", file=output)
  print(f"  PE ranking accuracy {metrics['pe_accuracy']:.3f}   distinct-1 "
        f"{metrics['distinct-1']:.3f}   distinct-2 {metrics['distinct-2']:.3f}", file=output)
  print(f"  train: nll {train.get('train/nll', float('nan')):.3f}  pe_loss "
        f"{train.get('train/pe_loss', float('nan')):.3f}  rank_accuracy "
        f"{train.get('train/rank_accuracy', float('nan')):.3f}", file=output)
  truth = demo_lib.diamante_truth_lines(per_context)  # printed once, by demo.run_all
  print("\n== sample replies (best of 8 by preference score) ==", file=output)
  contexts = [t.context for t in test_turns[:3]]
  replies = inference.respond(bundle, contexts, rng=jax.random.PRNGKey(seed), config=rerank)
  samples = [{"context": list(context), "response": reply.text, "score": float(reply.score),
              "candidates": [{"text": c.text, "score": float(c.score)}
                             for c in reply.candidates]}  # Best first.
             for context, reply in zip(contexts, replies, strict=True)]
  # As `diamante eval --output_path` writes them, beside the test file: `jaxmoral explore`
  # shows these metrics, replies and rankings on the test file's page without a model.
  fileio.write_text(os.path.join(workdir, "eval.json"), json.dumps(
      {**{k: float(v) for k, v in metrics.items() if not isinstance(v, (str, list, dict))},
       "samples": samples, "rankings": rankings}, indent=1))
  for context, reply in zip(contexts, replies, strict=True):
    for line in (f"  context: {' | '.join(context[-2:])}",
                 f"  reply:   {reply.text}   [{_candidates_note(reply)}]"):
      print(textwrap.fill(line, demo_lib.WIDTH, subsequent_indent=" " * 11), file=output)
  print("\n== self-chat ==", file=output)
  transcript = os.path.join(workdir, "self_chat.jsonl")
  chat.self_chat(model_dir=model_dir, opening="Hi! How was your weekend?",
                 num_rounds=4, transcript_path=transcript, rerank=rerank, seed=seed, output=output)
  return {"train": train, "eval": metrics, "model_dir": model_dir, "tensorboard": model_dir,
          "transcript": transcript, "truth": truth}
