"""The product loop against a bare train step: steps/s, MFU and peak host memory (RSS).

`product`: `jaxmoral.runs.train_run`, the loop `jaxmoral train` runs: a seqio Task of a TSV
file, tokenised (packed unless `--no_pack`) and written once to a data cache (`jaxmoral
cache`, before the timing), read from there by index, batches prefetched onto the devices,
TensorBoard events written, one checkpoint at the end. Its steps/s is the loop's own
TensorBoard figure over one window: from the end of the first step (compilation) to the end
of the last, the final checkpoint excluded.

`bare`: `Trainer.train_step` in a Python loop on one resident batch of the same cache (the
same model, optimizer, shapes and mesh), blocking only on the last step (what
`bench_train_mfu.py` times).

Each side runs in its own subprocess, so each one's peak RSS (`VmHWM`) is its own; rounds are
interleaved (product, bare, product, ...) and the ratio is that of each side's best round.
MFU is each side's model FLOPs per step (`bench_train_mfu.model_flops_per_step`) over
`--peak_tflops`. The children read the cache only, so they run where TensorFlow is not
installed: `--prepare DIR` writes the data (needs seqio) and `--prepared DIR` times on it, e.g.
on an accelerator host. Run from the project root:

  python bench/bench_loop_overhead.py --rounds 3
  python bench/bench_loop_overhead.py --prepare /tmp/lo --size large \
      --batch 64 --inputs 512 --targets 128 --no_pack          # where seqio is installed
  python bench/bench_loop_overhead.py --prepared /tmp/lo --size large \
      --dtype bfloat16 --optimizer adafactor --batch 64 --inputs 512 --targets 128 --no_pack \
      --override right_padded_inputs=true --rounds 2          # on the GPU host
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


def _data(args: argparse.Namespace, work: pathlib.Path):
  """The cached data both sides read (`runs.Seq2SeqData` over `work/cache`)."""
  from jaxmoral import runs  # pylint: disable=g-import-not-at-top
  return runs.Seq2SeqData(train_file=str(work / "pairs.tsv"), pack=args.pack,
                          cache_dir=str(work / "cache"))


def _lengths(args: argparse.Namespace) -> dict[str, int]:
  return {"inputs": args.inputs, "targets": args.targets}


def prepare(args: argparse.Namespace, work: pathlib.Path) -> None:
  """Writes the pairs, the demo vocabulary and the data cache (seqio, TensorFlow) into work."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  from jaxmoral import runs  # pylint: disable=g-import-not-at-top
  from jaxmoral.data import vocab  # pylint: disable=g-import-not-at-top
  work.mkdir(parents=True, exist_ok=True)
  _write_pairs(work / "pairs.tsv", args.pairs)
  vocabulary_path = vocab.build_demo_vocabulary(output_dir=work / "vocab")
  data = dataclasses.replace(_data(args, work), vocabulary_path=str(vocabulary_path))
  runs.cache_run(data=data, feature_lengths=_lengths(args), seed=0)


def child(args: argparse.Namespace) -> dict:
  work = pathlib.Path(args.work)
  from jaxmoral import runtime  # pylint: disable=g-import-not-at-top
  runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
  import jax  # pylint: disable=g-import-not-at-top
  from bench_train_step import parse_override  # pylint: disable=g-import-not-at-top

  from jaxmoral import metric_writers  # pylint: disable=g-import-not-at-top
  from jaxmoral import optimizers  # pylint: disable=g-import-not-at-top
  from jaxmoral import partitioning  # pylint: disable=g-import-not-at-top
  from jaxmoral import runs  # pylint: disable=g-import-not-at-top
  from jaxmoral import train as train_lib  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import config  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import trainable  # pylint: disable=g-import-not-at-top
  overrides = dict(parse_override(o) for o in args.override)
  model = trainable.Seq2SeqModel(config=config.t5_config(size=args.size, dtype=args.dtype,
                                                         **overrides))
  data = _data(args, work)
  optimizer = optimizers.make_optimizer(name=args.optimizer, learning_rate=1e-4)
  lengths = _lengths(args)
  loop_peak = None
  if args.side == "product":

    class PeakBeforeSave(train_lib.TrainHook):
      """The peak RSS of the loop alone: read once the last step has run (the loop itself
      does not wait for it), before its checkpoint."""

      def after_step(self, loop, step, state, metrics):
        nonlocal loop_peak
        if step == args.steps:
          jax.block_until_ready(state)
          loop_peak = _peak_rss_mib()

    model_dir = pathlib.Path(tempfile.mkdtemp(dir=args.run_root or work, prefix="run."))
    runs.train_run(model_dir=str(model_dir), model=model, data=data,
                   train_steps=args.steps, batch_size=args.batch, feature_lengths=lengths,
                   optimizer=optimizer, checkpoint_every=args.steps, log_every=args.steps,
                   eval_every=0, hooks=[PeakBeforeSave()])
    scalars = metric_writers.read_scalars(str(model_dir / "train"))
    steps_per_sec = scalars["steps_per_sec"][args.steps]
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
  return {"side": args.side, "steps_per_sec": steps_per_sec, "peak_rss_mib": _peak_rss_mib(),
          "loop_peak_rss_mib": loop_peak if loop_peak is not None else _peak_rss_mib(),
          "device": jax.devices()[0].device_kind, "jax": jax.__version__}


def _flops_per_step(args: argparse.Namespace) -> float:
  from bench_train_mfu import model_flops_per_step  # pylint: disable=g-import-not-at-top
  from bench_train_step import parse_override  # pylint: disable=g-import-not-at-top

  from jaxmoral.models import config  # pylint: disable=g-import-not-at-top
  cfg = config.t5_config(size=args.size, dtype=args.dtype,
                         **dict(parse_override(o) for o in args.override))
  return model_flops_per_step(cfg, args.batch, args.inputs, args.targets)


def pretraining_cache(data_dir: str, vocabulary_path: str) -> None:
  """Host memory and time of the input side of `configs/core/pretrain_span_corruption.gin`:
  one pass of its span-corruption Task (packed 256/58) into the index cache, then batches by
  index."""
  with tempfile.TemporaryDirectory() as tmp:
    os.environ["JAXMORAL_DATA_CACHE"] = os.path.join(tmp, "cache")
    from jaxmoral.data import pretraining_corpus  # pylint: disable=g-import-not-at-top
    from jaxmoral.data import tasks  # pylint: disable=g-import-not-at-top
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
  parser.add_argument("--dtype", default="float32", help="activation dtype")
  parser.add_argument("--optimizer", default="adamw")
  parser.add_argument("--override", action="append", default=[],
                      help="T5Config field=value (repeatable)")
  parser.add_argument("--no_pack", dest="pack", action="store_false")
  parser.add_argument("--pairs", type=int, default=4000)
  parser.add_argument("--peak_tflops", type=float, default=989.4,
                      help="the chip's dense bf16 peak for MFU (H100/H200 SXM: 989.4)")
  parser.add_argument("--prepare", metavar="DIR", help="only write the data into DIR")
  parser.add_argument("--prepared", metavar="DIR", help="time on the data --prepare wrote")
  parser.add_argument("--pretraining_cache", nargs=2, metavar=("DATA_DIR", "SPIECE_MODEL"),
                      help="instead: the pretraining config's input side alone (see "
                           "pretraining_cache)")
  parser.add_argument("--side", choices=["product", "bare"], help=argparse.SUPPRESS)
  parser.add_argument("--work", help=argparse.SUPPRESS)
  parser.add_argument("--run_root", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.pretraining_cache:
    pretraining_cache(*args.pretraining_cache)
    return
  if args.side:
    print("RESULT " + json.dumps(child(args)), flush=True)
    return
  if args.prepare:
    prepare(args, pathlib.Path(args.prepare))
    return
  import fair  # pylint: disable=g-import-not-at-top
  flops = _flops_per_step(args)
  print(f"# bench_loop_overhead  {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} "
        f"UTC\n# machine: {fair.machine_line()}\n# command: "
        f"{shlex.join([sys.executable, *sys.argv])}\n# T5 1.1-{args.size} {args.dtype} "
        f"{args.override}, {args.optimizer}, batch {args.batch}, lengths {args.inputs}/"
        f"{args.targets} ({'packed' if args.pack else 'padded'}), {args.steps} steps a round, "
        f"{flops / 1e12:.4f} model TFLOP/step", flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    work = pathlib.Path(args.prepared) if args.prepared else pathlib.Path(tmp)
    if not args.prepared:
      prepare(args, work)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    results: dict[str, list[dict]] = {"product": [], "bare": []}
    for round_ in range(1, args.rounds + 1):
      for side in ("product", "bare"):
        command = [sys.executable, __file__, "--side", side, "--work", str(work),
                   "--run_root", tmp, *[f"--{k}={getattr(args, k)}" for k in
                                        ("steps", "batch", "inputs", "targets", "size", "dtype",
                                         "optimizer")],
                   *[f"--override={o}" for o in args.override],
                   *([] if args.pack else ["--no_pack"])]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
        if done.returncode or not lines:
          print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
          raise SystemExit(f"{side} round {round_} failed")
        result = json.loads(lines[-1][len("RESULT "):])
        results[side].append(result)
        mfu = flops * result["steps_per_sec"] / 1e12 / args.peak_tflops
        print(f"round {round_} {side:8s} {result['steps_per_sec']:.3f} steps/s  MFU "
              f"{100 * mfu:.1f} %  peak RSS {result['peak_rss_mib']:.0f} MiB (before the "
              f"final checkpoint {result['loop_peak_rss_mib']:.0f} MiB)  "
              f"({result['device']}, jax {result['jax']})", flush=True)
  best = {side: max(r["steps_per_sec"] for r in rs) for side, rs in results.items()}
  peak = {side: max(r["peak_rss_mib"] for r in rs) for side, rs in results.items()}
  print(f"product/bare steps/s (best rounds): {best['product'] / best['bare']:.1%} "
        f"({best['product']:.3f} vs {best['bare']:.3f}); MFU "
        + " vs ".join(f"{100 * flops * best[s] / 1e12 / args.peak_tflops:.1f} %"
                      for s in ("product", "bare")))
  loop = {side: max(r["loop_peak_rss_mib"] for r in rs) for side, rs in results.items()}
  print(f"peak RSS product/bare: {peak['product']:.0f} / {peak['bare']:.0f} MiB = "
        f"{peak['product'] / peak['bare']:.2f}x; before the product's final checkpoint "
        f"{loop['product']:.0f} MiB = {loop['product'] / peak['bare']:.2f}x")


if __name__ == "__main__":
  main()
