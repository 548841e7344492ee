"""The rules every CPU benchmark against PyTorch follows.

A side-by-side number means something only when both sides do the same work on the same
footing. Each benchmark that times jaxmoral against PyTorch goes through this module:

1. **Same floating-point mode.** XLA:CPU flushes denormal floats to zero: its compute threads
   (the `tsl` thread pool, `tf_XLAEigen`) set FTZ/DAZ, and `prepare()` checks it by running a
   jitted product whose exact result is denormal. PyTorch keeps denormals by default, and a
   training step whose values decay into the denormal range can then run many times slower
   (the same PyTorch train step's time varied by an order of magnitude with this
   alone), so `prepare()` calls `torch.set_flush_denormal(True)` and checks that it took.
2. **Same threads.** `torch.set_num_threads` is set to the size of XLA:CPU's intra-op pool,
   counted from its live `tf_XLAEigen` threads after a first computation (it sizes itself to
   the cores this process may run on). Both counts are printed in the header.
3. **Same weights.** Both sides start from one set of jaxmoral parameters: `hf_model` converts
   them to a Hugging Face `T5ForConditionalGeneration` through `hf_import.name_table`, the
   table `jaxmoral export --format hf` writes with (in memory here, no files).
4. **Interleaved rounds.** `interleave` times round 1 of every side, then round 2 of every
   side, and so on, so drifts in a shared machine's load hit both alike. Every round is
   printed; the ratio is that of the best (shortest) round of each side.
5. **Agreement first.** Before any ratio, the two sides' results are compared (losses, step
   outputs, parameters after an update, scores or generated ids, depending on the benchmark)
   at float32 tolerance (`FLOAT32_RTOL`, `FLOAT32_ATOL` unless a benchmark states its own).
   `report` refuses to print a ratio when any check failed, prints the disagreement
   instead, and the benchmark exits with status 1.

`add_arguments` gives every benchmark `--rounds`, `--torch_threads` (default: XLA's count;
a different value is reported as unequal) and `--perturb_torch EPS` (multiplies each
PyTorch weight by 1 + EPS * N(0, 1): a way to watch the agreement check fail).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import re
import shlex
import sys
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

# Float32 agreement: |ours - theirs| <= FLOAT32_ATOL + FLOAT32_RTOL * |theirs|, elementwise,
# for quantities computed through a whole T5 (losses, scores, logits). Two float32 programs
# that sum in different orders differ by a few ulp per operation, which accumulates through
# 2 x 8 layers to ~1e-6 relative; 1e-4 leaves that a wide margin, while a mis-converted
# weight or a different optimizer convention is off by far more.
FLOAT32_RTOL = 1e-4
FLOAT32_ATOL = 1e-5
# Where products run in reduced precision (bfloat16 weights, or float32 on a GPU, whose
# default JAX precision multiplies in TF32 with a 10-bit mantissa) the bound is this instead.
REDUCED_RTOL = 2e-2


def tolerance(dtype: str = "float32", backend: str = "cpu") -> tuple[float, float, str]:
  """(rtol, atol, name) for comparing results computed in `dtype` on JAX's `backend`."""
  if dtype == "float32" and backend == "cpu":
    return FLOAT32_RTOL, FLOAT32_ATOL, "float32"
  why = "bfloat16" if dtype != "float32" else f"float32 on {backend} (TF32 products)"
  return REDUCED_RTOL, REDUCED_RTOL, f"reduced precision: {why}"


# -- set-up ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Setup:
  """What `prepare` set and measured; printed by `print_header`."""
  xla_threads: int  # live tf_XLAEigen threads (XLA:CPU's intra-op pool)
  affinity_cores: int  # cores this process may run on
  torch_threads: int  # torch.get_num_threads() after set-up
  torch_interop_threads: int
  torch_flush_denormal: bool  # torch.set_flush_denormal(True) returned True
  torch_flushes: bool  # a denormal product is 0 in PyTorch after set-up
  xla_flushes: bool  # the same product is 0 in a jitted XLA:CPU program
  platform: str  # JAX's default backend


def _count_threads(name: str) -> int:
  count = 0
  for task in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{task}/comm") as f:
        count += f.read().strip() == name
    except OSError:  # a thread that ended meanwhile
      pass
  return count


def xla_intra_op_threads() -> int:
  """XLA:CPU's intra-op pool size: its live `tf_XLAEigen` threads after a computation."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  x = jnp.ones((256, 256), jnp.float32)
  jax.block_until_ready(jax.jit(lambda a: a @ a)(x))
  return _count_threads("tf_XLAEigen") or len(os.sched_getaffinity(0))


def _xla_flushes_denormals() -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  x = np.full((1024,), 2e-38, np.float32)  # 2e-38 * 0.5 = 1e-38 < 1.18e-38, the least normal
  return bool(np.asarray(jax.jit(lambda v: v * np.float32(0.5))(x))[0] == 0)


def prepare(torch_threads: Optional[int] = None) -> Setup:
  """Flushes denormals in PyTorch and gives it XLA:CPU's thread count (or `torch_threads`)."""
  import jax  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  xla = xla_intra_op_threads()
  flush = bool(torch.set_flush_denormal(True))
  torch.set_num_threads(torch_threads or xla)
  torch_flushes = bool((torch.tensor([2e-38], dtype=torch.float32) * 0.5).item() == 0.0)
  return Setup(xla_threads=xla, affinity_cores=len(os.sched_getaffinity(0)),
               torch_threads=torch.get_num_threads(),
               torch_interop_threads=torch.get_num_interop_threads(),
               torch_flush_denormal=flush, torch_flushes=torch_flushes,
               xla_flushes=_xla_flushes_denormals(), platform=jax.default_backend())


def add_arguments(parser, *, rounds: int = 3) -> None:
  """The flags every fair comparison takes."""
  parser.add_argument("--rounds", type=int, default=rounds,
                      help="interleaved timed rounds per side (the best round of each counts)")
  parser.add_argument("--torch_threads", type=int, default=None,
                      help="PyTorch intra-op threads (default: as many as XLA:CPU's pool)")
  parser.add_argument("--perturb_torch", type=float, default=0.0,
                      help="multiply every PyTorch weight by 1 + EPS * N(0, 1): the agreement "
                           "check must then fail")


def machine_line() -> str:
  """CPU model, cores, memory and host: the machine a figure was measured on."""
  model = "unknown CPU"
  try:
    found = re.search(r"^model name\s*:(.*)$", open("/proc/cpuinfo").read(), re.M)
    model = found.group(1).strip() if found else platform.processor() or model
  except OSError:
    pass
  mem = ""
  try:
    kib = int(re.search(r"^MemTotal:\s*(\d+)", open("/proc/meminfo").read(), re.M).group(1))
    mem = f", {kib / 2 ** 20:.0f} GiB RAM"
  except (OSError, AttributeError):
    pass
  return (f"{model}, {len(os.sched_getaffinity(0))} cores usable of {os.cpu_count()}{mem}, "
          f"host {platform.node()}")


def print_header(title: str, setup: Setup, lines: Sequence[str] = ()) -> None:
  """Date, machine, command, versions, threads and denormal mode, then `lines`."""
  import jax  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  command = shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
  env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("XLA_FLAGS", "JAX_PLATFORMS")
                 if os.environ.get(k))
  same = setup.torch_threads == setup.xla_threads
  print(f"== {title} ==")
  print(f"date      : {now}")
  print(f"machine   : {machine_line()}")
  print(f"command   : python {command}")
  if env:  # what was in effect: the user's, the script's defaults, jaxmoral.backends.xla_flags' own
    print(f"xla env   : {env}")
  print(f"software  : python {platform.python_version()}, jax {jax.__version__} "
        f"({setup.platform}), torch {torch.__version__}, transformers {transformers.__version__}")
  print(f"threads   : XLA:CPU intra-op pool {setup.xla_threads} (live tf_XLAEigen threads), "
        f"PyTorch intra-op {setup.torch_threads} / inter-op {setup.torch_interop_threads}; "
        + ("equal" if same else "NOT EQUAL (--torch_threads)"))
  print(f"denormals : PyTorch set_flush_denormal(True) -> {setup.torch_flush_denormal}, "
        f"denormal product flushed: torch {setup.torch_flushes}, XLA {setup.xla_flushes}")
  print(f"load avg  : {' '.join(f'{x:.2f}' for x in os.getloadavg())} (before)")
  for line in lines:
    print(line)
  sys.stdout.flush()


# -- same weights ---------------------------------------------------------------------------------
def hf_state_dict(params: Mapping[str, Any], config) -> dict[str, Any]:
  """jaxmoral T5 params -> HF `T5ForConditionalGeneration` state dict (torch float32).

  The names and layouts are `hf_import.name_table`'s, the table `export_hf_t5` writes with
  (kernels transposed to (out, in), the relative bias to (buckets, heads)); the embedding
  copies HF keeps (`encoder.embed_tokens`, `decoder.embed_tokens`, a tied `lm_head`) are the
  same tensor as `shared.weight`.
  """
  import flax  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import hf_import  # pylint: disable=g-import-not-at-top
  flat = flax.traverse_util.flatten_dict(nn.meta.unbox(dict(params)))
  sd = {}
  for name, path, kind in hf_import.name_table(config, lm_head=not config.tie_word_embeddings):
    value = np.asarray(jax.device_get(flat[path]), dtype=np.float32)
    value = value.T if kind in ("linear", "relpos") else value
    sd[name] = torch.from_numpy(np.array(value, np.float32, order="C"))  # a copy we own
  for copy in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight") + (
      ("lm_head.weight",) if config.tie_word_embeddings else ()):
    sd[copy] = sd["shared.weight"]
  return sd


def hf_config(config):
  """The `transformers.T5Config` of a jaxmoral `T5Config` (dropout as configured)."""
  import transformers  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import hf_import  # pylint: disable=g-import-not-at-top
  values = hf_import.config_to_hf(config)
  values.pop("architectures")
  values.pop("model_type")
  out = transformers.T5Config(**values)
  # transformers 5's T5Config.__init__ consumes `tie_word_embeddings` into
  # `scale_decoder_outputs` and leaves the attribute at its default (True), which would tie
  # lm_head to the embedding; set it again so T5 1.1's separate head survives loading.
  out.tie_word_embeddings = config.tie_word_embeddings
  assert getattr(out, "scale_decoder_outputs",
                 config.tie_word_embeddings) == config.tie_word_embeddings
  return out


def hf_model(params: Mapping[str, Any], config, *, perturb: float = 0.0, seed: int = 0):
  """A `T5ForConditionalGeneration` (eval mode, float32) holding `params`.

  `perturb` > 0 multiplies every weight by 1 + perturb * N(0, 1) (the agreement checks'
  own check).
  """
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  model = transformers.T5ForConditionalGeneration(hf_config(config)).eval()
  missing, unexpected = model.load_state_dict(hf_state_dict(params, config), strict=False)
  if missing or unexpected:
    raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
  if not config.tie_word_embeddings and model.lm_head.weight is model.shared.weight:
    raise ValueError("HF model tied lm_head to the embedding; untied weights would be lost")
  # transformers 5 ties `encoder.embed_tokens` and `decoder.embed_tokens` to `shared` only
  # with `tie_word_embeddings`; T5 1.1 (untied head) would otherwise train three separate
  # embedding tables where jaxmoral (and T5X, and transformers 4) trains one. Share it.
  model.set_input_embeddings(model.shared)
  assert model.encoder.embed_tokens.weight is model.shared.weight
  assert model.decoder.embed_tokens.weight is model.shared.weight
  if perturb:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
      for p in model.parameters():
        p.mul_(1 + perturb * torch.randn(p.shape, generator=gen))
    print(f"NOTE: PyTorch weights perturbed by x(1 + {perturb:g} N(0,1)) (--perturb_torch); "
          "the agreement check should fail")
  return model


def hf_params_as_ours(model, config) -> dict[tuple[str, ...], np.ndarray]:
  """The HF model's current weights in jaxmoral's flat layout (path -> float32 array)."""
  from jaxmoral.models import hf_import  # pylint: disable=g-import-not-at-top
  sd = model.state_dict()
  out = {}
  for name, path, kind in hf_import.name_table(config, lm_head=not config.tie_word_embeddings):
    value = sd[name].detach().float().cpu().numpy()
    out[path] = value.T if kind in ("linear", "relpos") else value
  return out


# -- agreement ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Agreement:
  what: str
  ok: bool
  detail: str

  def line(self) -> str:
    return f"  {'ok  ' if self.ok else 'FAIL'} {self.what}: {self.detail}"


def compare(what: str, ours, theirs, *, rtol: float = FLOAT32_RTOL,
            atol: float = FLOAT32_ATOL) -> Agreement:
  """Elementwise |ours - theirs| <= atol + rtol * |theirs| (same shapes)."""
  a = np.asarray(ours, np.float64)
  b = np.asarray(theirs, np.float64)
  if a.shape != b.shape:
    return Agreement(what, False, f"shapes differ: {a.shape} vs {b.shape}")
  diff = np.abs(a - b)
  bound = atol + rtol * np.abs(b)
  bad = diff > bound
  worst = np.unravel_index(np.argmax(diff - bound), diff.shape) if diff.size else ()
  rel = float(np.max(diff / np.maximum(np.abs(b), 1e-30))) if diff.size else 0.0
  detail = (f"max |diff| {diff.max() if diff.size else 0:.3g}, max relative {rel:.3g} "
            f"(tolerance {atol:g} + {rtol:g} x |theirs|)")
  if a.size <= 4:
    detail = (f"ours {np.array2string(a, precision=7)} theirs "
              f"{np.array2string(b, precision=7)}; " + detail)
  if bad.any():
    detail += (f"; {int(bad.sum())}/{bad.size} outside, worst at {tuple(int(i) for i in worst)}"
               f": ours {a[worst]:.7g} theirs {b[worst]:.7g}")
  return Agreement(what, not bad.any(), detail)


def compare_relative_norm(what: str, ours: Sequence[np.ndarray], theirs: Sequence[np.ndarray],
                          reference: Sequence[np.ndarray], *, tol: float) -> Agreement:
  """||ours - theirs|| / ||reference|| <= tol over all arrays together (e.g. after an update:
  the difference of the two sides' parameters over the size of the update itself)."""
  num = np.sqrt(sum(float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
                    for a, b in zip(ours, theirs)))
  den = np.sqrt(sum(float(np.sum(np.asarray(r, np.float64) ** 2)) for r in reference))
  ratio = num / max(den, 1e-30)
  return Agreement(what, bool(ratio <= tol),
                   f"||ours - theirs|| / ||reference|| = {num:.3g} / {den:.3g} = {ratio:.3g} "
                   f"(tolerance {tol:g})")


def compare_greedy_ids(what: str, ours: np.ndarray, theirs: np.ndarray,
                       gap_fn: Optional[Callable[[int, int, int, int], tuple[float, float]]]
                       = None, *, tie_tol: float = FLOAT32_RTOL) -> Agreement:
  """Greedy token ids, (rows, length). Identical rows agree. A row that differs agrees only
  when, at its first differing position, the two chosen tokens were tied within float32
  tolerance: `gap_fn(row, position, our_token, their_token)` returns (|logit difference of
  the two tokens|, max |logit|) after the rows' shared prefix, and the gap must be
  <= tie_tol x max(1, max |logit|): a near-tie that rounding may break either way, after
  which the rows legitimately diverge. Without `gap_fn` any difference fails."""
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  if ours.shape != theirs.shape:
    return Agreement(what, False, f"shapes differ: {ours.shape} vs {theirs.shape}")
  same = (ours == theirs).all(axis=1)
  notes, ok = [], True
  for row in np.flatnonzero(~same):
    pos = int(np.argmax(ours[row] != theirs[row]))
    if gap_fn is None:
      ok = False
      notes.append(f"row {row} differs from position {pos}")
      continue
    gap, scale = gap_fn(int(row), pos, int(ours[row, pos]), int(theirs[row, pos]))
    bound = tie_tol * max(scale, 1.0)
    tied = gap <= bound
    ok &= tied
    notes.append(f"row {row} differs from position {pos} (tokens {ours[row, pos]} vs "
                 f"{theirs[row, pos]}): logit gap {gap:.3g} "
                 f"{'<=' if tied else '>'} {bound:.3g}, {'a tie' if tied else 'NOT a tie'}")
  detail = f"{int(same.sum())}/{len(same)} rows identical"
  return Agreement(what, bool(ok), detail + ("; " + "; ".join(notes) if notes else ""))


# -- timing ---------------------------------------------------------------------------------------
def interleave(sides: Mapping[str, Callable[[], Any]], rounds: int, *,
               calls_per_round: int = 1, label: str = "s/call",
               quiet: bool = False) -> dict[str, list[float]]:
  """Round r of every side (in order), then round r + 1, ...; prints each round (unless
  `quiet`: then the caller prints the rounds it returns).

  Each round times `calls_per_round` back-to-back calls of one side (the function must wait
  for its own result) and records the seconds per call.
  """
  times: dict[str, list[float]] = {name: [] for name in sides}
  width = max(len(name) for name in sides)
  for r in range(rounds):
    for name, fn in sides.items():
      start = time.perf_counter()
      for _ in range(calls_per_round):
        fn()
      per_call = (time.perf_counter() - start) / calls_per_round
      times[name].append(per_call)
      if not quiet:
        print(f"  round {r + 1}/{rounds}  {name:<{width}} {per_call:10.4f} {label}", flush=True)
  return times


def report(times: Mapping[str, Sequence[float]], checks: Sequence[Agreement], *,
           ours: str, theirs: str, work: Optional[float] = None, unit: str = "items") -> bool:
  """Prints the agreement checks, then each side's best round and the ratio of the best times
  (theirs / ours: > 1 means ours is faster) -- or, if any check failed, no ratio at all.
  Returns whether every check passed."""
  ok = all(c.ok for c in checks)
  print("agreement:")
  for c in checks:
    print(c.line())
  print("best rounds:")
  for name, t in times.items():
    best = min(t)
    rate = f"  {work / best:10.1f} {unit}/s" if work else ""
    print(f"  {name:<24} best {best:.4f} s{rate}  (rounds: "
          f"{', '.join(f'{x:.4f}' for x in t)})")
  if not ok:
    print(f"NO RATIO: {ours} and {theirs} disagree beyond float32 tolerance (see FAIL above); "
          "timing different computations says nothing")
  else:
    for name in times:
      if name != theirs:
        print(f"ratio {name} vs {theirs} (best {theirs} / best {name}): "
              f"{min(times[theirs]) / min(times[name]):.3f}x")
  print(f"load avg  : {' '.join(f'{x:.2f}' for x in os.getloadavg())} (after)", flush=True)
  return ok
