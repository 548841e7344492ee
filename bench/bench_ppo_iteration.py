"""One ClarifyDelphi PPO iteration at T5-small size: episodes/s with a per-phase breakdown.

Policy, value model, reference, answer generator, fusion model, judge and NLI filter are all
random T5 1.1-small networks (vocab 32128) with the real T5 SentencePiece vocabulary (from
../shared/vocab; the demo vocabulary otherwise). One iteration = rollout (sampling, top-p 0.6,
temperature 0.7) -> reward (judge s, θA weakener + strengthener, NLI, fusion, judge s ⊕ a, JSD)
-> score (old/reference log-probs, values, GAE) -> PPO update (epochs x minibatches). The first
iteration compiles; the following ones are timed.

  XLA_FLAGS=--xla_force_host_platform_device_count=1 python bench/bench_ppo_iteration.py \
      --batch 16 --iterations 2
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxmoral import runtime  # noqa: E402
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral import optimizers, partitioning  # noqa: E402
from jaxmoral.clarify import data as data_lib  # noqa: E402
from jaxmoral.clarify import formats, models, reward  # noqa: E402
from jaxmoral.data import vocab as vocab_lib  # noqa: E402
from jaxmoral.models import config as config_lib  # noqa: E402
from jaxmoral.models import t5  # noqa: E402
from jaxmoral.rl import ppo_trainer  # noqa: E402

T5_SPM = pathlib.Path(__file__).resolve().parents[2] / "shared" / "vocab" / "t5_tokenizer" / \
    "spiece.model"


class _Timer:
  """Accumulates wall time of wrapped functions (reward sub-phases)."""

  def __init__(self):
    self.seconds = collections.defaultdict(float)

  def wrap(self, name, fn):
    def timed(*args, **kwargs):
      tick = time.perf_counter()
      out = fn(*args, **kwargs)
      self.seconds[name] += time.perf_counter() - tick
      return out
    return timed


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", default="small")
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--epochs", type=int, default=4)
  parser.add_argument("--minibatches", type=int, default=4)
  parser.add_argument("--prompt_length", type=int, default=64)
  parser.add_argument("--response_length", type=int, default=32)
  parser.add_argument("--answer_length", type=int, default=32)
  parser.add_argument("--fusion_length", type=int, default=48)
  parser.add_argument("--iterations", type=int, default=2, help="including the compiling one")
  parser.add_argument("--no_nli", action="store_true")
  parser.add_argument("--json", default=None, help="also write the results here")
  parser.add_argument("--spm", default=str(T5_SPM),
                      help="the T5 SentencePiece model (the demo vocabulary if absent)")
  args = parser.parse_args()

  t5_vocabulary = pathlib.Path(args.spm).is_file()
  spm = args.spm if t5_vocabulary else vocab_lib.build_demo_vocabulary(
      output_dir=tempfile.mkdtemp())
  vocabulary = vocab_lib.get_vocabulary(spm)
  classes = formats.T5_JUDGE_CLASSES if t5_vocabulary else formats.DEMO_JUDGE_CLASSES
  config = config_lib.t5_config(size=args.size, vocab_size=32128)
  model = t5.T5(config)

  def random_model(seed):
    params = nn.meta.unbox(t5.init_params(model, jax.random.PRNGKey(seed)))
    return models.ClarifyModel(model, params, vocabulary=vocabulary)

  reward_config = reward.RewardConfig(
      judge_classes=classes, batch_size=args.batch, input_length=args.prompt_length + 32,
      max_answer_length=args.answer_length, max_fusion_length=args.fusion_length,
      use_nli=not args.no_nli)
  fn = reward.DefeasibilityReward(answer_model=random_model(1), fusion_model=random_model(2),
                                  judge_model=random_model(3),
                                  nli_model=None if args.no_nli else random_model(4),
                                  config=reward_config)
  timer = _Timer()
  fn.judge = timer.wrap("judge", fn.judge)
  fn.answers = timer.wrap("answers", fn.answers)
  fn.fuse = timer.wrap("fusion", fn.fuse)
  if fn.nli is not None:
    object.__setattr__(fn.nli, "probabilities", timer.wrap("nli", fn.nli.probabilities))

  ppo_config = ppo_trainer.PPOConfig(
      batch_size=args.batch, num_ppo_epochs=args.epochs, num_minibatches=args.minibatches,
      max_prompt_length=args.prompt_length, max_response_length=args.response_length,
      normalize_reward=False)
  partitioner = partitioning.PjitPartitioner()
  trainer = ppo_trainer.PPOTrainer(
      policy_model=model, value_model=t5.T5(config, with_scalar_head=True),
      vocabulary=vocabulary, config=ppo_config,
      optimizer=optimizers.make_optimizer(name="adamw", learning_rate=1e-5),
      partitioner=partitioner, reward_fn=fn)
  state = trainer.init_state(jax.random.PRNGKey(0),
                             policy_params=random_model(0).params)
  situations = (data_lib.situations("demo") * 4)[:args.batch]
  tokens, texts = trainer.encode_prompts([formats.question_input(s) for s in situations])

  rows = []
  for it in range(args.iterations):
    timer.seconds.clear()
    tick = time.perf_counter()
    state, metrics, _ = trainer.iteration(state, tokens, texts, jax.random.PRNGKey(it))
    total = time.perf_counter() - tick
    row = {"iteration": it, "compile": it == 0, "total_s": total,
           "episodes_per_s": args.batch / total,
           **{k: metrics[k] for k in metrics if k.startswith("time/")},
           **{f"reward/{k}_s": v for k, v in timer.seconds.items()}}
    rows.append(row)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
  timed = [r for r in rows if not r["compile"]] or rows
  mean = {k: float(np.mean([r[k] for r in timed])) for k in timed[0]
          if isinstance(timed[0][k], float)}
  print(f"\nT5-{args.size} (vocab 32128), batch {args.batch} situations, "
        f"{args.epochs} epochs x {args.minibatches} minibatches, responses <= "
        f"{args.response_length} tokens, {jax.devices()[0].platform} x {jax.device_count()}:")
  print(f"  {mean['episodes_per_s']:.3f} episodes/s ({mean['total_s']:.2f} s / iteration)")
  for k in sorted(mean):
    if k.startswith(("time/", "reward/")):
      print(f"  {k:<22} {mean[k]:8.2f} s  ({100 * mean[k] / mean['total_s']:5.1f}%)")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows,
                                                   "mean": mean}, indent=2))


if __name__ == "__main__":
  main()
