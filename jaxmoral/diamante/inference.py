"""Generation–evaluation inference: sample N candidates, score each, answer with the best.

Candidates come from the core sampler (`jaxmoral.decoding.sample`) and are scored by one batched
decoder pass over them (`model.score_responses`). The sampler's own cache cannot be reused for
the scores because its rows end at different positions while the cache position is shared; the
extra pass costs about one teacher-forced step of N rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax
import gin
import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import decoding
from jaxmoral import validation
from jaxmoral.diamante import data
from jaxmoral.diamante.bundle import Bundle
from jaxmoral.diamante.model import score_responses
from jaxmoral.models.t5 import T5

Array = jax.Array


@gin.configurable
@dataclasses.dataclass(frozen=True, kw_only=True)
class RerankConfig:
  """Sampling and reranking settings (the paper: top-k 10, 20 candidates per context);
  `no_repeat_ngram_size` blocks within a candidate (0 = off), `max_decode_length` counts EOS."""
  num_candidates: int = 20
  top_k: int = 10
  temperature: float = 1.0
  no_repeat_ngram_size: int = 3
  max_decode_length: int = 32

  def __post_init__(self):
    validation.positive_int(self.num_candidates, "RerankConfig.num_candidates")
    validation.positive_int(self.max_decode_length, "RerankConfig.max_decode_length")
    validation.non_negative_int(self.top_k, "RerankConfig.top_k")
    if not self.temperature > 0:
      raise ValueError(f"RerankConfig.temperature must be > 0, got {self.temperature!r}")
    validation.non_negative_int(self.no_repeat_ngram_size, "RerankConfig.no_repeat_ngram_size")


@flax.struct.dataclass
class RerankOutput:
  """Candidates of a batch of contexts: tokens (B, N, T) (EOS included, zeros after), lengths
  (B, N) (with EOS), preference `scores` and generation `logprobs` (B, N), and (B,) the index
  of the `best`-scored one."""
  tokens: Array
  lengths: Array
  scores: Array
  logprobs: Array
  best: Array


def generate_and_rank(model: T5, params: Any, encoder_input_tokens: Array, rng: Array,
                      config: RerankConfig) -> RerankOutput:
  """Samples `config.num_candidates` responses per context and scores them (jittable; run
  on the bundle's mesh by `Bundle.run`)."""
  out = decoding.sample(model, params, encoder_input_tokens=encoder_input_tokens, rng=rng,
                        max_decode_length=config.max_decode_length,
                        num_samples=config.num_candidates, temperature=config.temperature,
                        top_k=config.top_k, no_repeat_ngram_size=config.no_repeat_ngram_size,
                        eos_id=model.config.eos_token_id)
  scores, logprobs, lengths = score_responses(model, params, encoder_input_tokens, out.tokens,
                                              out.lengths)
  return RerankOutput(tokens=out.tokens, lengths=out.lengths, scores=scores, logprobs=logprobs,
                      best=jnp.argmax(scores, axis=-1))


@dataclasses.dataclass(frozen=True)
class Candidate:
  text: str
  score: float
  logprob: float


@dataclasses.dataclass(frozen=True)
class Reply:
  """The chosen response and all candidates, best first."""
  text: str
  score: float
  candidates: tuple[Candidate, ...]


def respond(bundle: Bundle, contexts: Sequence[Sequence[str]], *, rng: Array,
            config: RerankConfig = RerankConfig()) -> list[Reply]:
  """The best-scored of N sampled responses for each context (oldest utterance first)."""
  if not contexts:
    return []
  encoder = np.stack([data.encode_context(bundle.vocabulary, c, bundle.features)
                      for c in contexts])
  out = bundle.run(generate_and_rank, encoder, np.asarray(rng), static=(config,))
  replies = []
  for b in range(len(contexts)):
    texts = bundle.decode_text(out.tokens[b])
    cands = sorted((Candidate(texts[i], float(out.scores[b, i]), float(out.logprobs[b, i]))
                    for i in range(config.num_candidates)), key=lambda c: -c.score)
    replies.append(Reply(cands[0].text, cands[0].score, tuple(cands)))
  return replies


def rank_texts(bundle: Bundle, context: Sequence[str], responses: Sequence[str],
               ) -> tuple[np.ndarray, np.ndarray]:
  """Preference scores and generation log-probs of given responses to one context."""
  encoder = data.encode_context(bundle.vocabulary, context, bundle.features)[None]
  targets = np.stack([data.encode_response(bundle.vocabulary, r, bundle.features)
                      for r in responses])[None]
  scores, logprobs = score_batch(bundle, encoder, targets)
  return scores[0], logprobs[0]


def score_batch(bundle: Bundle, encoder: np.ndarray, targets: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
  """`score_responses` on host arrays, on the bundle's mesh: (scores (B, N), logprobs (B, N))."""
  scores, logprobs, _ = bundle.run(score_responses, encoder, targets)
  return np.asarray(scores), np.asarray(logprobs)
