"""Model candidates for a dialogue corpus that has none, sampled once and stored.

As the paper did for DuSinc: a generator samples `num_candidates` top-k responses for every
response position, written back in the Diamante format with `response_candidates` filled in;
training then re-draws r_M from these stored candidates every epoch.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import gin
import jax
import numpy as np

from jaxmoral import partitioning
from jaxmoral import progress
from jaxmoral.diamante import bundle as bundle_lib
from jaxmoral.diamante import data


def sample_candidates(bundle: bundle_lib.Bundle, contexts: Sequence[Sequence[str]], *,
                      num_candidates: int, top_k: int = 10, temperature: float = 1.0,
                      no_repeat_ngram_size: int = 3, max_decode_length: int = 32,
                      batch_size: int = 32, seed: int = 0) -> list[list[str]]:
  """`num_candidates` sampled responses per context (fixed batch shape, one compilation)."""
  sampler = bundle.sampler(max_decode_length=max_decode_length, num_samples=num_candidates,
                           greedy=False, temperature=temperature, top_k=top_k,
                           no_repeat_ngram_size=no_repeat_ngram_size)
  key = jax.random.PRNGKey(seed)
  out: list[list[str]] = []
  shown = progress.ProgressLog("candidate contexts", len(contexts))
  for start in range(0, len(contexts), batch_size):
    chunk = list(contexts[start:start + batch_size])
    encoder = np.zeros((batch_size, bundle.features.context_length), np.int32)
    for row, context in enumerate(chunk):
      encoder[row] = data.encode_context(bundle.vocabulary, context, bundle.features)
    key, sub = jax.random.split(key)
    result = jax.device_get(sampler(bundle.params, bundle.place(encoder), rng=sub,
                                    decode_weights=bundle.decode_weights))
    out.extend(bundle.decode_text(result.tokens[row]) for row in range(len(chunk)))
    shown.update(len(out))
  return out


@gin.configurable
def generate_candidates(*, model_dir: str, input_path: Optional[str] = None,
                        turns: Optional[Sequence[data.Turn]] = None, output_path: str,
                        num_candidates: int = 5, top_k: int = 10, temperature: float = 1.0,
                        no_repeat_ngram_size: int = 3, max_decode_length: int = 32,
                        batch_size: int = 32, seed: int = 0, partitioner: Any = None) -> int:
  """Samples candidates for every response position, writes a Diamante JSONL; returns the
  number of dialogues written.

  Args:
    model_dir: The generator's run directory or export.
    input_path: Dialogues in the Diamante format (candidates ignored), or `turns` read already.
    top_k, temperature, no_repeat_ngram_size, max_decode_length: Sampling, as
      `inference.RerankConfig`'s (the paper: top-k 10).
    batch_size: Contexts per sampler call.
    partitioner: The mesh the model runs on (the run's PARTITIONER; None: `inference_partitioner`).
  """
  if (input_path is None) == (turns is None):
    raise ValueError("generate_candidates: give exactly one of input_path, turns")
  if num_candidates < 1:
    raise ValueError(f"generate_candidates: num_candidates must be >= 1, got {num_candidates}")
  turns = data.read_dialogues(str(input_path)) if turns is None else turns
  bundle = bundle_lib.load(model_dir, partitioner=partitioning.inference_partitioner(partitioner))
  # Each dialogue's utterances: its last turn's (longest) context and response.
  dialogues = [[*ts[-1].context, ts[-1].response] for ts in data.by_dialogue(turns).values()]
  contexts = [d[:i] for d in dialogues for i in range(1, len(d))]
  sampled = iter(sample_candidates(bundle, contexts, num_candidates=num_candidates, top_k=top_k,
                                   temperature=temperature,
                                   no_repeat_ngram_size=no_repeat_ngram_size,
                                   max_decode_length=max_decode_length, batch_size=batch_size,
                                   seed=seed))
  records: list[tuple[Any, list[Any]]] = [
      (d, [[]] + [next(sampled) for _ in range(1, len(d))]) for d in dialogues]
  written = data.write_dialogues(output_path, records)
  print(f"wrote {written} dialogues ({len(contexts)} responses, {num_candidates} candidates "
        f"each) to {output_path}")
  return written
