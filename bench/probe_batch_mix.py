"""How mixed a training stream's batches are: the kinds of example in each batch.

A training file stored in blocks (a multi-task file written task by task, a classifier file
sorted by label) reaches training in blocks when the loader shuffles only within a window.
This streams a text-pair file through the training loader (`runs.Seq2SeqData` ->
`tasks.TaskSource`, as `train_run` does) and counts, per batch, the kinds of its examples: an
example's kind is its input up to the first ":" (the task prefix of a T5 multi-task file) or,
with --by_target, its target.

  python bench/probe_batch_mix.py --train_file=MODEL_DIR/data/multitask_train.jsonl \
      --vocabulary=../shared/vocab/t5_tokenizer/spiece.model
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from jaxmoral import runtime  # noqa: E402
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral import runs  # noqa: E402
from jaxmoral.data import vocab  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--train_file", required=True, help="A .jsonl of inputs / targets.")
  parser.add_argument("--vocabulary", required=True, help="SentencePiece model.")
  parser.add_argument("--batches", type=int, default=500)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--by_target", action="store_true", help="Kind = the target text.")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  with open(args.train_file, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  kind_of = {}
  for row in rows:
    text = row["targets"] if args.by_target else row["inputs"].split(":")[0]
    kind_of[row["inputs"]] = text
  vocabulary = vocab.get_vocabulary(args.vocabulary)
  data = runs.Seq2SeqData(train_file=args.train_file)
  source, _ = data.sources(vocabulary=vocabulary, batch_size=args.batch_size,
                           feature_lengths={"inputs": 512, "targets": 8}, seed=args.seed)
  # Inputs are matched by their tokens (decoding would not give back the exact text).
  by_tokens = {tuple(vocabulary.encode(text)): kind for text, kind in kind_of.items()}
  stream = source.iterate(0)
  commonest, single, distinct = [], 0, []
  for step in range(args.batches):
    kinds = []
    for row in next(stream)["encoder_input_tokens"]:
      tokens = tuple(int(t) for t in row if t)[:-1]  # Without padding and EOS.
      kinds.append(by_tokens.get(tokens, "?"))
    counts = collections.Counter(kinds)
    commonest.append(counts.most_common(1)[0][1] / len(kinds))
    single += len(counts) == 1
    distinct.append(len(counts))
    if step % 100 == 0:
      print(f"batch {step}: {dict(counts)}", flush=True)
  overall = collections.Counter(kind_of[r["inputs"]] for r in rows)
  print(f"{len(rows)} pairs of {len(overall)} kinds: {dict(overall)}")
  print(f"{args.batches} batches of {args.batch_size}: the commonest kind's share of a batch "
        f"{np.mean(commonest):.3f} on average (the file's commonest kind: "
        f"{max(overall.values()) / len(rows):.3f}); batches of one kind only: "
        f"{single / args.batches:.1%}; kinds per batch {np.mean(distinct):.2f}")


if __name__ == "__main__":
  main()
