"""Train-step throughput: jaxmoral (JAX/XLA) vs transformers' PyTorch T5, same weights, same CPU.

T5 1.1-small (float32, dropout 0), AdamW with the same hyperparameters on both sides, batch 8,
128 input and 64 target tokens by default, under `bench/fair.py`'s rules: PyTorch flushes
denormals as XLA:CPU does and runs as many threads as XLA's pool; both sides start from the
same weights (jaxmoral's initialisation, converted to a HF state dict); the first two steps of
each side are compared (loss of step 1 = same forward; gradient norm of step 1 = same backward;
loss of step 2 and every parameter after step 2 = same AdamW update) before anything is timed;
then `--rounds` interleaved rounds of `--steps` steps each (ours, theirs, ours, ...), every
round printed, and the ratio of the best rounds -- or no ratio if the checks failed.
The peer runs at its best: torch.optim.AdamW's fused implementation (its CPU default is the
slower per-parameter loop); `--torch_adamw for_loop,foreach,fused` makes each implementation a
side of its own, checked and timed, and takes the ratio against the fastest.

Optimizer equivalence: `optax.adamw` (what `optimizers.make_optimizer(name="adamw")` builds)
and `torch.optim.AdamW` compute the same update. Both bias-correct m and v, add `eps` outside
the square root (optax's `eps_root` is 0), and decay weights decoupled from the gradient,
scaled by the learning rate, from the parameter before the step: optax adds `wd * p` to the
Adam direction and multiplies the sum by `-lr`; torch first multiplies `p` by `1 - lr * wd`.
Both decay every parameter (no mask). Their defaults differ (optax `weight_decay=1e-4`,
torch `0.01`), so every hyperparameter is passed explicitly to both from one dict, and torch's
parameter group is read back and compared with it. (The parameter check catches an L2 penalty
in the gradient instead of decoupled decay; a decay that differs only in size moves weights
by lr x wd = 1e-6 relative per step, below what two steps resolve, hence the read-back.)

Also prints the achieved FLOP/s against the machine's float32 peak, measured by
`bench/machine.py`. FLOPs per step come from XLA's cost analysis of the compiled step (the
same model, so it is used for both frameworks), with the 6 * params * tokens rule alongside.

  python bench/bench_train_step.py                  # the record: small, 8 x (128 + 64)
  python bench/bench_train_step.py --tiny           # smoke test, seconds
  python bench/bench_train_step.py --tiny --perturb_torch 1e-3   # the check must fail
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

if __name__ == "__main__":  # A CPU benchmark; bench_train_mfu.py imports make_batch from here.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import flax  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fair  # noqa: E402  (bench/fair.py)
import machine  # noqa: E402  (bench/machine.py)
from jaxmoral import runtime  # noqa: E402
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral import losses, optimizers, partitioning, trainer as trainer_lib  # noqa: E402
from jaxmoral.models import config as config_lib  # noqa: E402
from jaxmoral.models import t5  # noqa: E402

CHECK_STEPS = 2  # untimed steps per side whose results are compared (and warm up)
# Parameters after CHECK_STEPS AdamW steps: ||ours - theirs|| over ||ours - initial||. Adam's
# first steps move each weight by about lr * sign(gradient); where a gradient is at float32
# noise level its sign can differ between the two programs, so the updates agree to a small
# fraction, not to rounding (T5 1.1-small and tiny: a few 1e-4). A weight that differs by
# 1e-3 relative (`--perturb_torch 1e-3`) moves this to O(1).
UPDATE_TOL = 5e-3


def parse_override(text: str) -> tuple[str, object]:
  """'field=value' -> (field, int | float | bool | str value) for a T5Config override."""
  name, _, value = text.partition("=")
  for cast in (int, float):
    try:
      return name, cast(value)
    except ValueError:
      pass
  return name, {"true": True, "false": False}.get(value.lower(), value)


def make_batch(cfg: config_lib.T5Config, batch: int, inputs: int, targets: int) -> dict:
  rs = np.random.RandomState(0)
  enc = rs.randint(2, cfg.vocab_size, (batch, inputs)).astype(np.int32)
  dec = rs.randint(2, cfg.vocab_size, (batch, targets)).astype(np.int32)
  return {"encoder_input_tokens": enc, "decoder_target_tokens": dec,
          "decoder_input_tokens": np.asarray(t5.shift_right(jnp.asarray(dec))),
          "decoder_loss_weights": np.ones_like(dec)}


def adamw_hyperparameters(learning_rate: float = 1e-4, weight_decay: float = 0.01) -> dict:
  """The AdamW settings every train-step benchmark passes to both optax and torch."""
  return dict(learning_rate=learning_rate, b1=0.9, b2=0.999, eps=1e-8,
              weight_decay=weight_decay)


def initial_params(cfg: config_lib.T5Config) -> dict:
  """jaxmoral's initialisation (seed 0) on the host: every side starts from these weights."""
  return jax.device_get(nn.meta.unbox(t5.init_params(t5.T5(cfg), jax.random.PRNGKey(0))))


def step_inputs(size: str = "small", batch: int = 8, inputs: int = 128, targets: int = 64
                ) -> tuple[config_lib.T5Config, dict, dict, dict]:
  """(config, batch, initial weights, AdamW settings) of a train-step benchmark: the step every
  CPU train-step script times, T5 1.1-small, 8 x (128 + 64), by default."""
  cfg = config_lib.t5_config(size=size, dropout_rate=0.0)
  return (cfg, make_batch(cfg, batch, inputs, targets), initial_params(cfg),
          adamw_hyperparameters())


class JaxSide:
  """jaxmoral's Trainer: seq2seq loss (no z-loss, no label smoothing), AdamW with `hp` (or the
  optimizer given)."""

  def __init__(self, cfg, batch, params0, hp: dict, optimizer=None):
    model = t5.T5(cfg)
    self.trainer = trainer_lib.Trainer(
        init_params_fn=functools.partial(t5.init_params, model),
        loss_fn=losses.seq2seq_loss_fn(model, z_loss=0.0),
        optimizer=optimizer or optimizers.make_optimizer(name="adamw", **hp),
        partitioner=partitioning.PjitPartitioner(devices=jax.devices()[:1]))
    self.shapes = {k: v.shape for k, v in batch.items()}
    self.batch = self.trainer.shard_batch(batch)
    self.state = self.trainer.init_state_from_params(params0)
    self.rng = jax.random.PRNGKey(1)  # dropout is 0: unused

  def flops(self) -> float:
    cost = self.trainer.lower_train_step(self.shapes).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])

  def step(self) -> dict:
    self.state, metrics = self.trainer.train_step(self.state, self.batch, self.rng)
    jax.block_until_ready((self.state, metrics))
    return metrics

  def params(self) -> dict:
    return flax.traverse_util.flatten_dict(jax.device_get(self.state.params))


# torch.optim.AdamW's three implementations (same update); on CPU its default is the
# per-parameter loop.
TORCH_ADAMW = {"for_loop": dict(foreach=False, fused=False),
               "foreach": dict(foreach=True, fused=False),
               "fused": dict(foreach=False, fused=True)}


class TorchSide:
  """transformers' T5ForConditionalGeneration (train mode, dropout 0), torch.optim.AdamW."""

  def __init__(self, cfg, batch, params0, hp: dict, perturb: float, adamw_impl: str):
    import torch  # pylint: disable=g-import-not-at-top
    self.torch = torch
    self.model = fair.hf_model(params0, cfg, perturb=perturb).train()
    self.opt = torch.optim.AdamW(self.model.parameters(), lr=hp["learning_rate"],
                                 betas=(hp["b1"], hp["b2"]), eps=hp["eps"],
                                 weight_decay=hp["weight_decay"],
                                 **TORCH_ADAMW[adamw_impl])
    self.inputs, self.labels, self.dec_in = (
        torch.tensor(np.array(batch[k]), dtype=torch.long)
        for k in ("encoder_input_tokens", "decoder_target_tokens", "decoder_input_tokens"))

  def step(self, grad_norm: bool = False) -> dict:
    self.opt.zero_grad(set_to_none=True)
    out = self.model(input_ids=self.inputs, attention_mask=self.inputs != 0,
                     decoder_input_ids=self.dec_in, labels=self.labels)
    out.loss.backward()
    metrics = {"loss": out.loss.detach()}
    if grad_norm:  # only in the untimed check steps
      metrics["grad_norm"] = self.torch.sqrt(sum(
          (p.grad.double() ** 2).sum() for p in self.model.parameters() if p.grad is not None))
    self.opt.step()
    return metrics


def torch_checks(theirs: "TorchSide", cfg, ours_m: list, p_ours: dict, p0: dict,
                 paths: list, hp: dict) -> list:
  """The agreement checks of one PyTorch side against jaxmoral's first CHECK_STEPS steps."""
  theirs_m = [{k: float(v) for k, v in theirs.step(grad_norm=True).items()}
              for _ in range(CHECK_STEPS)]
  p_theirs = fair.hf_params_as_ours(theirs.model, cfg)
  group = theirs.opt.param_groups[0]
  got = dict(learning_rate=group["lr"], b1=group["betas"][0], b2=group["betas"][1],
             eps=group["eps"], weight_decay=group["weight_decay"])
  odd = {k: v for k, v in (("amsgrad", group["amsgrad"]), ("maximize", group["maximize"]))
         if v}
  return [
      fair.Agreement("AdamW hyperparameters (torch's param group vs the ones optax got)",
                     got == hp and not odd, f"torch {got}{odd or ''}, optax {hp}"),
      fair.compare("loss of step 1 (same weights, same forward)", ours_m[0]["loss"],
                   theirs_m[0]["loss"]),
      fair.compare("gradient norm of step 1 (same backward)", ours_m[0]["grad_norm"],
                   theirs_m[0]["grad_norm"]),
      fair.compare("loss of step 2 (after one AdamW update)", ours_m[1]["loss"],
                   theirs_m[1]["loss"]),
      fair.compare_relative_norm(
          f"all parameters after {CHECK_STEPS} steps, relative to the update",
          [p_ours[k] for k in paths], [p_theirs[k] for k in paths],
          [p_ours[k] - p0[k] for k in paths], tol=UPDATE_TOL),
  ]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="small")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--inputs", type=int, default=128)
  parser.add_argument("--targets", type=int, default=64)
  parser.add_argument("--steps", type=int, default=2, help="timed steps per round and side")
  parser.add_argument("--learning_rate", type=float, default=1e-4)
  parser.add_argument("--weight_decay", type=float, default=0.01)
  parser.add_argument("--skip_torch", action="store_true",
                      help="time jaxmoral alone (no comparison, no ratio)")
  parser.add_argument("--tiny", action="store_true",
                      help="smoke test: size tiny, batch 2 x (16 + 8), 1 step x 2 rounds")
  parser.add_argument("--override", action="append", default=[],
                      help="T5Config field=value of jaxmoral's side, a compute option such as "
                           "remat=true (repeatable; the weights stay the same)")
  parser.add_argument("--torch_adamw", default="fused",
                      help="torch.optim.AdamW's implementations timed on PyTorch's side "
                           f"(comma-separated, of {sorted(TORCH_ADAMW)}); the ratio is taken "
                           "against the fastest. Default: fused, the fastest on CPU")
  fair.add_arguments(parser, rounds=3)
  args = parser.parse_args()
  if args.tiny:
    args.size, args.batch, args.inputs, args.targets, args.steps, args.rounds = (
        "tiny", 2, 16, 8, 1, 2)

  impls = args.torch_adamw.split(",")
  if not impls or set(impls) - set(TORCH_ADAMW) or len(set(impls)) != len(impls):
    parser.error(f"--torch_adamw {args.torch_adamw!r}: comma-separated, each once, of "
                 f"{sorted(TORCH_ADAMW)}")
  setup = fair.prepare(args.torch_threads)
  overrides = dict(parse_override(o) for o in args.override)
  # Dropout and the dtype are fixed: PyTorch's side runs float32 without dropout.
  allowed = sorted(set(config_lib.COMPUTE_FIELDS) - {"dropout_rate", "dtype"})
  unknown = sorted(set(overrides) - set(allowed))
  if unknown:
    parser.error(f"--override: {unknown} cannot be set here; T5Config fields that can: "
                 f"{allowed}")
  cfg = config_lib.t5_config(size=args.size, dropout_rate=0.0, **overrides)
  batch = make_batch(cfg, args.batch, args.inputs, args.targets)
  tokens = args.batch * (args.inputs + args.targets)
  hp = adamw_hyperparameters(args.learning_rate, args.weight_decay)
  peak = machine.measured_peak()
  fair.print_header(
      "train step: jaxmoral Trainer vs transformers T5ForConditionalGeneration + "
      "torch.optim.AdamW", setup,
      [f"model     : T5 {args.size} ({cfg.num_params() / 1e6:.1f}M params), float32, dropout "
       f"0, same initial weights (jaxmoral's init -> HF state dict)"
       + (f"; jaxmoral's compute options {overrides}" if overrides else ""),
       f"batch     : {args.batch} x (inputs {args.inputs} + targets {args.targets}) = {tokens} "
       f"tokens/step",
       f"optimizer : AdamW lr {hp['learning_rate']:g}, betas ({hp['b1']}, {hp['b2']}), eps "
       f"{hp['eps']:g}, decoupled weight decay {hp['weight_decay']:g} (optax.adamw / "
       f"torch.optim.AdamW: {', '.join(impls)})",
       f"timing    : {CHECK_STEPS} untimed check steps per side, then {args.rounds} interleaved "
       f"rounds x {args.steps} steps per side",
       f"peak      : {peak.note}"])

  params0 = initial_params(cfg)
  ours = JaxSide(cfg, batch, params0, hp)
  flops = ours.flops()
  rule = 6.0 * cfg.num_params() * tokens
  # 6 * params * tokens over-counts an encoder-decoder: encoder weights see only input tokens,
  # decoder weights only target tokens, and the embedding lookup costs no FLOPs.
  print(f"FLOPs/step: XLA cost analysis {flops / 1e9:.2f} G (used below); 6*params*tokens "
        f"{rule / 1e9:.2f} G (over-counts enc-dec)", flush=True)

  if args.skip_torch:
    for _ in range(CHECK_STEPS):
      ours.step()
    times = fair.interleave({"jaxmoral": ours.step}, args.rounds, calls_per_round=args.steps,
                            label="s/step")
    best = min(times["jaxmoral"])
    print(f"jaxmoral best {best:.4f} s/step  {tokens / best:.1f} tokens/s  "
          f"{flops / best / 1e9:.1f} GFLOP/s ({100 * flops / best / peak.flops:.1f}% of peak); "
          "no PyTorch side, no ratio")
    return

  ours_m = [jax.device_get(ours.step()) for _ in range(CHECK_STEPS)]
  p_ours = ours.params()
  p0 = flax.traverse_util.flatten_dict(params0)
  paths = sorted(p0)
  sides, checks = {"jaxmoral": ours.step}, []
  for impl in impls:
    theirs = TorchSide(cfg, batch, params0, hp, args.perturb_torch, impl)
    checks += [dataclasses.replace(c, what=f"[{impl}] {c.what}")
               for c in torch_checks(theirs, cfg, ours_m, p_ours, p0, paths, hp)]
    sides[f"pytorch/{impl}"] = theirs.step
  del p_ours

  print(f"timed rounds ({args.steps} steps each; interleaved):", flush=True)
  times = fair.interleave(sides, args.rounds, calls_per_round=args.steps, label="s/step")
  # The peer at its best: the ratio is taken against PyTorch's fastest AdamW.
  fastest = min((name for name in times if name != "jaxmoral"), key=lambda n: min(times[n]))
  ok = fair.report(times, checks, ours="jaxmoral", theirs=fastest, work=tokens,
                   unit="tokens")
  for name, t in times.items():
    best = min(t)
    print(f"  {name:<16} best round: {flops / best / 1e9:7.1f} GFLOP/s = "
          f"{100 * flops / best / peak.flops:.1f}% of the measured peak")
  if not ok:
    sys.exit(1)


if __name__ == "__main__":
  main()
