"""The product loop against a bare train step: steps/s and peak host memory (RSS).

`product`: `jaxmoral.runs.train_run`, the loop `jaxmoral train` runs: a seqio Task read from a
TSV file, tokenised and packed (`tasks.TaskSource`, its index cache built before the timing),
batches prefetched onto the devices, TensorBoard events written, one checkpoint at the end.
Its steps/s is the loop's own TensorBoard figure over one window: from the end of the first
step (compilation) to the end of the last, the final checkpoint excluded.

`bare`: `Trainer.train_step` in a Python loop on one resident batch of the same Task (the same
model, optimizer, shapes and mesh), blocking only on the last step (what `bench_train_mfu.py`
times).

Each side runs in its own subprocess, so each one's peak RSS (`VmHWM`) is its own; rounds are
interleaved (product, bare, product, ...) and the ratio is that of each side's best round.
Run from the project root:

  PYTHONPATH=$PWD python bench/bench_loop_overhead.py --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def _peak_rss_mib() -> float:
  with open("/proc/self/status", encoding="utf-8") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 1024
  return float("nan")


def _write_pairs(path: pathlib.Path, count: int) -> None:
  """A TSV of (situation -> question) pairs from the demo data, repeated to `count` rows."""
  from jaxmoral.data import demo  # pylint: disable=g-import-not-at-top
  rows = [(r["situation"], r["question"]) for r in demo.clarify_questions()]
  with open(path, "w", encoding="utf-8") as f:
    f.write("inputs\ttargets\n")
    for i in range(count):
      situation, question = rows[i % len(rows)]
      f.write(f"{situation} ({i})\t{question}\n")


def _setup(args: argparse.Namespace, work: pathlib.Path):
  """(model, data spec, optimizer, lengths) shared by both sides."""
  from jaxmoral import optimizers, runs  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import config, trainable  # pylint: disable=g-import-not-at-top
  model = trainable.Seq2SeqModel(config=config.t5_config(size=args.size))
  data = runs.Seq2SeqData(train_file=str(work / "pairs.tsv"),
                          vocabulary_path=(work / "vocab_path").read_text(), pack=True)
  optimizer = optimizers.make_optimizer(name="adamw", learning_rate=1e-4)
  lengths = {"inputs": args.inputs, "targets": args.targets}
  return model, data, optimizer, lengths


def child(args: argparse.Namespace) -> dict:
  work = pathlib.Path(args.work)
  os.environ["JAXMORAL_DATA_CACHE"] = str(work / "cache")
  import jax  # pylint: disable=g-import-not-at-top
  from jaxmoral import partitioning, runs, train as train_lib  # pylint: disable=g-import-not-at-top
  model, data, optimizer, lengths = _setup(args, work)
  if args.side == "product":
    model_dir = pathlib.Path(tempfile.mkdtemp(dir=work, prefix="run."))
    runs.train_run(model_dir=str(model_dir), model=model, data=data,
                   train_steps=args.steps, batch_size=args.batch, feature_lengths=lengths,
                   optimizer=optimizer, checkpoint_every=args.steps, log_every=args.steps,
                   eval_every=0)
    steps_per_sec = train_lib.read_scalars(str(model_dir / "train"))["steps_per_sec"][args.steps]
  else:
    vocabulary = data.vocabulary(str(work / "vocab"))
    train_source, _ = data.sources(vocabulary=vocabulary, batch_size=args.batch,
                                   feature_lengths=lengths, seed=0)
    trainer = runs.make_trainer(model=model, optimizer=optimizer,
                                partitioner=partitioning.PjitPartitioner())
    state = trainer.init_state(jax.random.PRNGKey(0))
    batch = trainer.shard_batch(train_source.batch(0))
    rng = jax.random.PRNGKey(1)
    state, metrics = trainer.train_step(state, batch, rng)
    jax.block_until_ready(metrics)
    tick = time.perf_counter()
    for _ in range(args.steps - 1):
      state, metrics = trainer.train_step(state, batch, rng)
    jax.block_until_ready(metrics)
    steps_per_sec = (args.steps - 1) / (time.perf_counter() - tick)
  return {"side": args.side, "steps_per_sec": steps_per_sec, "peak_rss_mib": _peak_rss_mib()}


def pretraining_cache(data_dir: str, vocabulary_path: str) -> None:
  """Host memory and time of the input side of `configs/core/pretrain_span_corruption.gin`:
  one pass of its span-corruption Task (packed 256/58) into the index cache, then batches by
  index."""
  with tempfile.TemporaryDirectory() as tmp:
    os.environ["JAXMORAL_DATA_CACHE"] = os.path.join(tmp, "cache")
    from jaxmoral.data import pretraining_corpus, tasks  # pylint: disable=g-import-not-at-top
    task = pretraining_corpus.register_pretraining_mixture(
        data_dir=data_dir, vocabulary_path=vocabulary_path, output_dir=os.path.join(tmp, "corpus"),
        sources=["clarify", "silver", "fusion", "perspectrum", "demo", "chitchat"])  # the config's
    print(f"corpus registered: peak RSS {_peak_rss_mib():.0f} MiB", flush=True)
    source = tasks.TaskSource(task.name, "train", {"inputs": 256, "targets": 58}, 32, pack=True)
    tick = time.perf_counter()
    features, meta = source._cached_rows()  # pylint: disable=protected-access
    print(f"one pass cached: {meta['rows']} rows, "
          f"{sum(v.nbytes for v in features.values()) / 2 ** 20:.1f} MiB on disk, "
          f"{time.perf_counter() - tick:.1f} s; peak RSS {_peak_rss_mib():.0f} MiB", flush=True)
    tick = time.perf_counter()
    for step in (10, 100, 599):
      source.batch(step)
    print(f"batches 10, 100, 599 by index: {time.perf_counter() - tick:.4f} s; peak RSS "
          f"{_peak_rss_mib():.0f} MiB", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--inputs", type=int, default=64)
  parser.add_argument("--targets", type=int, default=16)
  parser.add_argument("--size", default="small", help="t5_config size (T5 1.1 small: 77M)")
  parser.add_argument("--pairs", type=int, default=4000)
  parser.add_argument("--pretraining_cache", nargs=2, metavar=("DATA_DIR", "SPIECE_MODEL"),
                      help="instead: the pretraining config's input side alone (see "
                           "pretraining_cache)")
  parser.add_argument("--side", choices=["product", "bare"], help=argparse.SUPPRESS)
  parser.add_argument("--work", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.pretraining_cache:
    pretraining_cache(*args.pretraining_cache)
    return
  if args.side:
    print("RESULT " + json.dumps(child(args)), flush=True)
    return
  sys.path.insert(0, str(HERE))
  import fair  # pylint: disable=g-import-not-at-top
  print(f"# bench_loop_overhead  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
        f"UTC\n# machine: {fair.machine_line()}\n# command: "
        f"{shlex.join([sys.executable, *sys.argv])}\n# T5 1.1-{args.size}, batch {args.batch}, "
        f"lengths {args.inputs}/{args.targets} (packed), {args.steps} steps a round", flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    work = pathlib.Path(tmp)
    from jaxmoral.data import vocab  # pylint: disable=g-import-not-at-top
    (work / "vocab_path").write_text(str(vocab.build_demo_vocabulary(output_dir=work / "vocab")))
    _write_pairs(work / "pairs.tsv", args.pairs)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    results: dict[str, list[dict]] = {"product": [], "bare": []}
    for round_ in range(1, args.rounds + 1):
      for side in ("product", "bare"):
        command = [sys.executable, __file__, "--side", side, "--work", str(work),
                   *[f"--{k}={getattr(args, k)}" for k in
                     ("steps", "batch", "inputs", "targets", "size")]]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
        if done.returncode or not lines:
          print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
          raise SystemExit(f"{side} round {round_} failed")
        result = json.loads(lines[-1][len("RESULT "):])
        results[side].append(result)
        print(f"round {round_} {side:8s} {result['steps_per_sec']:.3f} steps/s  peak RSS "
              f"{result['peak_rss_mib']:.0f} MiB", flush=True)
  best = {side: max(r["steps_per_sec"] for r in rs) for side, rs in results.items()}
  peak = {side: max(r["peak_rss_mib"] for r in rs) for side, rs in results.items()}
  print(f"product/bare steps/s (best rounds): {best['product'] / best['bare']:.1%} "
        f"({best['product']:.3f} vs {best['bare']:.3f})")
  print(f"peak RSS product/bare: {peak['product']:.0f} / {peak['bare']:.0f} MiB = "
        f"{peak['product'] / peak['bare']:.2f}x")


if __name__ == "__main__":
  main()
