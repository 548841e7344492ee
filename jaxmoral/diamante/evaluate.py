"""Test-split evaluation: does the preference score find the human response? (paper, Fig. 3)

For every test context the human response r_H is ranked among that context's model
candidates and `num_random` human responses from other dialogues, by the preference score
s(c, r) and by the generation log-probability log p(r | c) (summed, and per token): MAP, MRR
and P@1 (`metrics.ranking_metrics`, ties counted against r_H), beside a random ranker's P@1.
Also the PE ranking accuracy and distinct-1/2 of reranked responses to the first contexts.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import gin
import jax
import numpy as np

from jaxmoral import fileio
from jaxmoral import metrics as metrics_lib
from jaxmoral import partitioning
from jaxmoral.diamante import bundle as bundle_lib
from jaxmoral.diamante import data
from jaxmoral.diamante import inference


def ranking_items(turns: Sequence[data.Turn], *, num_random: int, max_candidates: int,
                  seed: int, encode: Optional[Callable[[str], Sequence[int]]] = None
                  ) -> list[tuple[int, list[str], list[int]]]:
  """Per usable turn: (turn index, responses, kinds: `data.HUMAN` / `MODEL` / `RANDOM`), r_H
  first, up to `max_candidates` model candidates and `num_random` human responses of other
  dialogues (drawn with `seed`).

  Candidates equal to r_H or to an earlier one, and random responses equal to r_H, are dropped
  (a second correct answer); turns without a remaining candidate are skipped. With `encode`
  (what the scorer reads of a response: `model_view`), "equal" also means the same tokens:
  their tie would be broken by float summation order, which changes with the batch shape.
  """
  def identities(text: str) -> set[tuple[str, object]]:
    ids: set[tuple[str, object]] = {("text", data.normalize(text))}
    if encode is not None:
      ids.add(("tokens", tuple(encode(text))))
    return ids

  rng = np.random.default_rng(seed)
  out = []
  for i, turn in enumerate(turns):
    human = identities(turn.response)
    cands: list[str] = []
    seen = set(human)
    for c in turn.candidates:
      if len(cands) == max_candidates:
        break
      ids = identities(c)
      if seen.isdisjoint(ids):
        cands.append(c)
        seen |= ids
    if not cands:
      continue
    randoms = data.random_responses(turns, turn, num_random, rng, tries=50 * num_random,
                                    excluded=human, key=identities)
    out.append((i, [turn.response, *cands, *randoms],
                [data.HUMAN] + [data.MODEL] * len(cands) + [data.RANDOM] * len(randoms)))
  return out


def model_view(bundle: bundle_lib.Bundle) -> Callable[[str], Sequence[int]]:
  """The response tokens the bundle's scorer reads (truncated, EOS): `ranking_items`' encode."""
  return lambda text: data.encode_response(bundle.vocabulary, text, bundle.features).tolist()


def pe_accuracy(scores: np.ndarray, kinds: np.ndarray) -> float:
  """Fraction of the (human > model), (human > random), (model > random) pairs scored right."""
  good, total = 0, 0
  for better, worse in ((data.HUMAN, data.MODEL), (data.HUMAN, data.RANDOM),
                        (data.MODEL, data.RANDOM)):
    a, b = scores[kinds == better], scores[kinds == worse]
    good += int(np.sum(a[:, None] > b[None, :]))  # 0 pairs where a kind is absent.
    total += a.size * b.size
  return good / total if total else float("nan")


def score_ranking_items(bundle: bundle_lib.Bundle, turns: Sequence[data.Turn],
                        items: Sequence[tuple[int, Sequence[str], Sequence[int]]], *,
                        width: int, batch_size: int
                        ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """Scores `ranking_items` in batches of fixed shape (batch_size, width): one compilation for
  the whole test set. Yields per item, in order, its n responses' (n,) preference scores
  s(c, r), summed generation log-probabilities and tokens (EOS included)."""
  feats = bundle.features
  for start in range(0, len(items), batch_size):
    chunk = items[start:start + batch_size]
    encoder = np.zeros((batch_size, feats.context_length), np.int32)
    targets = np.zeros((batch_size, width, feats.response_length), np.int32)
    targets[:, :, 0] = feats.eos_id
    for row, (i, responses, _) in enumerate(chunk):
      encoder[row] = data.encode_context(bundle.vocabulary, turns[i].context, feats)
      for k, text in enumerate(responses):
        targets[row, k] = data.encode_response(bundle.vocabulary, text, feats)
    scores, logprobs = inference.score_batch(bundle, encoder, targets)
    lengths = np.sum(targets > 0, axis=-1)
    for row, (_, responses, _) in enumerate(chunk):
      n = len(responses)
      yield scores[row, :n], logprobs[row, :n], lengths[row, :n]


RANKERS = ("preference", "generation", "generation_per_token")
NUM_SAMPLES = 5  # Generated responses kept in the evaluation JSON, for a person to read.
NUM_RANKINGS = 20  # Ranked contexts kept there (`rank_contexts`).
RANKING_METRICS = ("map", "mrr", "p@1")
KIND_NAMES = {data.HUMAN: "human", data.MODEL: "model", data.RANDOM: "random"}


def rank_contexts(bundle: bundle_lib.Bundle, turns: Sequence[data.Turn], *, num_random: int = 5,
                  max_candidates: int = 10, max_contexts: Optional[int] = None,
                  batch_size: int = 8, seed: int = 0,
                  rankings: Optional[list] = None) -> dict[str, np.ndarray]:
  """Ranking metrics of the human response, per context (for means and bootstrap intervals).

  A `rankings` list receives the first `NUM_RANKINGS` contexts as ranked, for a person (and
  `jaxmoral explore`) to read without the model: `{"turn", "context", "responses", "kinds",
  "scores", "logprobs", "lengths"}`, the responses in `ranking_items`' order.

  Returns:
    `{"<ranker>/<metric>"` (`RANKERS` x `RANKING_METRICS`), `"pe_accuracy"` (NaN where
    undefined), `"random/p@1"` (expected), `"turn"` (index into `turns`)`}`, each (C,) over
    the C usable contexts.

  Raises:
    ValueError: on bad counts, or when no turn has a model candidate different from r_H.
  """
  if num_random < 0 or max_candidates < 1 or batch_size < 1:
    raise ValueError("rank_contexts: need num_random >= 0, max_candidates >= 1, batch_size >= 1")
  items = ranking_items(turns, num_random=num_random, max_candidates=max_candidates, seed=seed,
                        encode=model_view(bundle))[:max_contexts]
  if not items:
    raise ValueError("rank_contexts: no test turn has a model candidate different from r_H")
  out: dict[str, list[float]] = {"pe_accuracy": [], "random/p@1": [], "turn": []}
  scored = score_ranking_items(bundle, turns, items, batch_size=batch_size,
                               width=1 + max_candidates + num_random)
  for (turn, responses, kind_list), (scores, logprobs, lengths) in zip(items, scored, strict=True):
    kinds = np.asarray(kind_list)
    if rankings is not None and len(rankings) < NUM_RANKINGS:
      rankings.append({
          "turn": turn, "context": list(turns[turn].context), "responses": list(responses),
          "kinds": [KIND_NAMES[int(k)] for k in kinds], "scores": scores.tolist(),
          "logprobs": logprobs.tolist(), "lengths": lengths.tolist()})
    labels = kinds == data.HUMAN
    by_ranker = {"preference": scores, "generation": logprobs,
                 "generation_per_token": logprobs / lengths}
    for ranker, values in by_ranker.items():
      ranked = metrics_lib.ranking_metrics([values], [labels])
      for key in RANKING_METRICS:
        out.setdefault(f"{ranker}/{key}", []).append(ranked[key])
    out["pe_accuracy"].append(pe_accuracy(scores, kinds))
    out["random/p@1"].append(1.0 / len(kinds))
    out["turn"].append(turn)
  return {k: np.asarray(v, np.float64) for k, v in out.items()}


def ranking_summary(per_context: dict[str, np.ndarray]) -> dict[str, float]:
  """Means over contexts of `rank_contexts`' arrays (MAP, MRR and P@1 are such means)."""
  return {"num_contexts": float(len(per_context["turn"])),
          **{f"{ranker}/{key}": float(np.mean(per_context[f"{ranker}/{key}"]))
             for ranker in RANKERS for key in RANKING_METRICS},
          "random/p@1": float(np.mean(per_context["random/p@1"])),
          "pe_accuracy": float(np.nanmean(per_context["pe_accuracy"]))}


def generation_metrics(bundle: bundle_lib.Bundle, contexts: Sequence[Sequence[str]], *,
                       rerank: inference.RerankConfig, batch_size: int = 8,
                       seed: int = 0, samples: Optional[list] = None) -> dict[str, float]:
  """distinct-1/2 and the mean preference score of reranked responses to `contexts`; with a
  `samples` list, the first `NUM_SAMPLES` (context, response, score) are appended to it."""
  key = jax.random.PRNGKey(seed)
  replies = []
  for start in range(0, len(contexts), batch_size):
    key, sub = jax.random.split(key)
    chunk = list(contexts[start:start + batch_size])
    padded = chunk + [chunk[-1]] * (batch_size - len(chunk))  # fixed shape
    replies.extend(inference.respond(bundle, padded, rng=sub, config=rerank)[:len(chunk)])
  texts = [r.text for r in replies]
  if samples is not None:
    samples.extend({"context": list(c), "response": r.text, "score": float(r.score)}
                   for c, r in list(zip(contexts, replies, strict=True))[:NUM_SAMPLES])
  return {"distinct-1": metrics_lib.distinct_n(texts, 1),
          "distinct-2": metrics_lib.distinct_n(texts, 2),
          "generated/mean_score": float(np.mean([r.score for r in replies]))}


def evaluate_turns(bundle: bundle_lib.Bundle, turns: Sequence[data.Turn], *, num_random: int = 5,
                   max_candidates: int = 10, max_contexts: Optional[int] = None,
                   num_generate: int = 0, rerank: inference.RerankConfig = inference.RerankConfig(),
                   batch_size: int = 8, seed: int = 0, samples: Optional[list] = None,
                   rankings: Optional[list] = None) -> dict[str, float]:
  """The evaluation of a loaded bundle on in-memory turns (see module docstring):
  `ranking_summary`'s means, and with `num_generate > 0` `generation_metrics`'. A `samples`
  list receives a few generated responses, a `rankings` list the first ranked contexts."""
  per_context = rank_contexts(bundle, turns, num_random=num_random,
                              max_candidates=max_candidates, max_contexts=max_contexts,
                              batch_size=batch_size, seed=seed, rankings=rankings)
  result = ranking_summary(per_context)
  if num_generate > 0:
    contexts = [turns[int(i)].context for i in per_context["turn"][:num_generate]]
    result.update(generation_metrics(bundle, contexts, rerank=rerank, batch_size=batch_size,
                                     seed=seed, samples=samples))
  return result


@gin.configurable
def evaluate(*, model_dir: str, test_path: str, output_path: Optional[str] = None,
             num_random: int = 5, max_candidates: int = 10, max_contexts: Optional[int] = None,
             num_generate: int = 50, rerank: Optional[inference.RerankConfig] = None,
             batch_size: int = 8, seed: int = 0, partitioner: Any = None) -> dict[str, float]:
  """Evaluates a trained Diamante model on a Diamante-format test file (`evaluate_turns`).

  Args:
    model_dir: A run directory (its `export/`) or an export directory.
    test_path: Diamante-format JSONL with response candidates.
    output_path: Also write the metrics as JSON here, with a few generated responses
      ("samples") and the first ranked contexts ("rankings", see `rank_contexts`).
    num_random: Random responses (from other dialogues) added to each ranking.
    max_candidates: Model candidates per context at most.
    max_contexts: Evaluate only the first this many usable contexts.
    num_generate: Contexts to generate reranked responses for (distinct-n); 0 skips.
    rerank: Sampling/reranking settings for those generations (None: as `chat.chat`'s).
    batch_size: Contexts per scoring batch.
    seed: Random responses and sampling.
    partitioner: The mesh the model runs on (the run's PARTITIONER; None: `inference_partitioner`).
  """
  turns = data.read_dialogues(test_path)  # A bad test file fails before the model loads.
  bundle = bundle_lib.load(model_dir, partitioner=partitioning.inference_partitioner(partitioner))
  samples: list = []
  rankings: list = []
  result = evaluate_turns(bundle, turns, samples=samples, rankings=rankings,
                          num_random=num_random, max_candidates=max_candidates,
                          max_contexts=max_contexts, num_generate=num_generate,
                          rerank=rerank or inference.RerankConfig(), batch_size=batch_size,
                          seed=seed)
  print(format_summary(result))
  if output_path is not None:
    with fileio.open_text_writer(output_path) as f:
      json.dump({**result, "samples": samples, "rankings": rankings}, f, indent=2, sort_keys=True)
    print(f"wrote {output_path}")
  return result


def format_summary(result: Mapping[str, float]) -> str:
  """`evaluate_turns`' numbers as a table for a person: one row per ranker (MAP, MRR, P@1 of
  the human response among the candidates), then the other measures, with n."""
  lines = [f"{'ranker':<22}" + "".join(f"{m:>8}" for m in RANKING_METRICS),
           "-" * (22 + 8 * len(RANKING_METRICS))]
  for ranker in RANKERS:
    lines.append(f"{ranker:<22}" + "".join(f"{result[f'{ranker}/{m}']:>8.3f}"
                                           for m in RANKING_METRICS))
  lines.append(f"{'random (expected)':<22}{'':>8}{'':>8}{result['random/p@1']:>8.3f}")
  lines.append(f"n = {int(result['num_contexts'])} contexts; preference accuracy "
               f"{result['pe_accuracy']:.3f}")
  extra = {k: v for k, v in result.items() if k in ("distinct-1", "distinct-2",
                                                    "generated/mean_score")}
  if extra:
    lines.append("generated responses: " + ", ".join(f"{k} {v:.3f}" for k, v in extra.items()))
  return "\n".join(lines)
