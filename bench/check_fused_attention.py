"""On a GPU: T5 with cuDNN fused attention against the einsum path (logits, loss, gradients).

The CPU tests run the fused path through JAX's reference kernel; this runs the real cuDNN
kernel in bfloat16 and prints, for a padded batch (dense mask), the same batch with
`right_padded_inputs` (key lengths) and a packed batch, the largest difference to einsum in
bfloat16, beside the difference between einsum in bfloat16 and in float32 (the noise that
bfloat16 alone brings). The fused path is right when its difference is of that size.

  python bench/check_fused_attention.py [--size small]
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import runtime
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral import losses
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5


def batches(vocab: int) -> dict[str, dict[str, np.ndarray]]:
  rs = np.random.RandomState(0)
  b, n, m = 8, 64, 32
  enc = rs.randint(2, vocab, (b, n)).astype(np.int32)
  for row, length in enumerate(rs.randint(8, n + 1, b)):
    enc[row, length:] = 0
  tgt = rs.randint(2, vocab, (b, m)).astype(np.int32)
  padded = {"encoder_input_tokens": enc, "decoder_target_tokens": tgt,
            "decoder_input_tokens": np.asarray(t5.shift_right(jnp.asarray(tgt)))}
  enc_seg = np.zeros((b, n), np.int32)
  dec_seg = np.zeros((b, m), np.int32)
  enc_seg[:, :20], enc_seg[:, 20:50] = 1, 2
  dec_seg[:, :12], dec_seg[:, 12:28] = 1, 2
  packed_in = np.where(dec_seg > 0, padded["decoder_input_tokens"], 0)
  packed_in[:, 12] = 0
  packed = {"encoder_input_tokens": np.where(enc_seg > 0, np.maximum(enc, 2), 0),
            "decoder_target_tokens": np.where(dec_seg > 0, tgt, 0),
            "decoder_input_tokens": packed_in, "encoder_segment_ids": enc_seg,
            "decoder_segment_ids": dec_seg}
  return {"padded": padded, "packed": packed}


def run(cfg: config_lib.T5Config, params, batch):
  model = t5.T5(cfg)
  loss_fn = losses.seq2seq_loss_fn(model)
  grads, metrics = jax.jit(jax.grad(lambda p: loss_fn(p, batch, None), has_aux=True))(params)
  logits = jax.jit(lambda p: model.apply(
      {"params": p}, batch["encoder_input_tokens"], batch["decoder_input_tokens"],
      encoder_segment_ids=batch.get("encoder_segment_ids"),
      decoder_segment_ids=batch.get("decoder_segment_ids")))(params)
  return np.asarray(logits, np.float32), grads, float(metrics["loss"])


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="small")
  parser.add_argument("--backend", default="cudnn",
                      help="jax.nn.dot_product_attention implementation (xla: a CPU smoke test)")
  args = parser.parse_args()
  base = config_lib.t5_config(size=args.size, dtype="bfloat16", attention_impl="einsum",
                              fused_attention_backend=args.backend)
  params = nn.meta.unbox(jax.jit(lambda r: t5.init_params(t5.T5(base), r))(
      jax.random.PRNGKey(0)))
  print(f"T5 1.1-{args.size}, jax {jax.__version__} on {jax.devices()[0].device_kind}")
  for name, batch in batches(base.vocab_size).items():
    valid = batch.get("decoder_segment_ids", np.ones(batch["decoder_target_tokens"].shape)) > 0
    f32 = run(base.replace(dtype="float32"), params, batch)
    bf16 = run(base, params, batch)
    cases = {"cudnn, dense mask": base.replace(attention_impl="cudnn")}
    if name == "padded":
      cases["cudnn, key lengths"] = base.replace(attention_impl="cudnn", right_padded_inputs=True)
    worst = max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(bf16[1]),
                                          jax.tree_util.tree_leaves(f32[1])))
    print(f"{name}: einsum bf16 vs f32: logits {rel(bf16[0][valid], f32[0][valid]):.1e}, "
          f"loss {bf16[2]:.5f} vs {f32[2]:.5f}, worst gradient {worst:.1e}")
    for label, cfg in cases.items():
      out = run(cfg, params, batch)
      leaves = zip(jax.tree_util.tree_leaves(out[1]), jax.tree_util.tree_leaves(bf16[1]))
      worst = max(rel(a, b) for a, b in leaves)
      relpos = rel(out[1]["encoder"]["relpos_bias"]["rel_embedding"],
                   bf16[1]["encoder"]["relpos_bias"]["rel_embedding"])
      print(f"  {label} vs einsum bf16: logits {rel(out[0][valid], bf16[0][valid]):.1e}, "
            f"loss {out[2]:.5f}, worst gradient {worst:.1e}, encoder relpos gradient "
            f"{relpos:.1e}", flush=True)


if __name__ == "__main__":
  main()
