"""NPOV error detection, Table 1 shape: do ROUGE-1, salience and the classifiers detect errors?

Chang et al. (LREC-COLING 2024), Table 1: on synthetic hallucinations (an argument removed from
the input, still verbalised) and coverage errors (an argument added to the input, not
verbalised), unparaphrased and paraphrased, ROUGE-1, gradient x input salience of the
generator and prompt-tuned YES/NO classifiers detect both kinds above chance (example level,
unparaphrased hallucination / coverage: ROUGE-1 .772 / .890, salience .736 / .875, classifiers
.998 / .986; `PAPER_TABLE1`). Each verdict also needs every detector above its nulls, in the
same run on the same examples (`NULLS`): the detector on an untrained model, the lengths of
its input and response. Checked here on PERSPECTRUM (907
claims, split train/dev/test by its own `dataset_split_v1.0.json`), from a span-corruption-
pretrained T5 (INIT_CHECKPOINT), with the library's own pieces (as `jaxmoral npov demo` runs
them on the bundled corpus):

1. verbalisation examples of the train claims (`knowledge_base.sample_examples`, several
   argument subsets per claim, template responses); the base fine-tuned on them
   (`runs.train_run`), then a generator soft prompt and one YES/NO classifier prompt per error
   type over that frozen base (`prompt_tuning.PromptTuningModel`,
   `detectors.classifier.train_classifier`; the classifiers learn from synthetic errors of the
   train claims);
2. error-free examples of the held-out (test) claims and their synthetic errors
   (`synthetic.make_test_slices`: per source example the clean one, a hallucination and a
   coverage error, each also paraphrased);
3. every detector (`detect.build_detector`) on both slices: ROC AUC at example and word level
   (`evaluate.evaluate_slice`) with 95 % bootstrap intervals (examples resampled; at word
   level whole examples, their words together).

  python experiments/npov_table1.py --gin_file=configs/experiments/npov_table1_cpu.gin \
      --gin.INIT_CHECKPOINT="'/work/runs/pretrain_mini'"

Writes `<RESULTS_DIR>/<NAME>.md`, `.json` and `.png`; runs go under WORKDIR (a rerun resumes).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Mapping, Optional, Sequence

import gin
import numpy as np

import experiment_lib as common  # puts the project root on sys.path

logger = logging.getLogger("npov_table1")

ERRORS = ("hallucination", "coverage")
LEVELS = ("example", "word")
# The report's levels: the plot's, and the within-example word AUC beside them.
REPORT_LEVELS = (*LEVELS, "word_within")
# Confound controls, scored like detectors: the synthetic errors change the input's length;
# with balanced error-free examples (as many arguments per side) they always unbalance the
# sides; and they leave the template response one point more or fewer than the input has
# arguments. A score that follows any of these separates errors without reading content.
CONTROL = "input_length"
IMBALANCE_CONTROL = "side_imbalance"
COUNT_CONTROL = "point_count"
# The paper's Table 1, example-level ROC AUC on its synthetic slices, the ones built here:
# {(slice, error): {detector: AUC}}.
PAPER_TABLE1 = {
    ("unparaphrased", "hallucination"): {"rouge": 0.772, "salience": 0.736, "classifier": 0.998},
    ("unparaphrased", "coverage"): {"rouge": 0.890, "salience": 0.875, "classifier": 0.986},
    ("paraphrased", "hallucination"): {"rouge": 0.680, "salience": 0.708, "classifier": 0.977},
    ("paraphrased", "coverage"): {"rouge": 0.746, "salience": 0.831, "classifier": 0.993}}


def _paper_figures(detector: str) -> str:
  """`hallucination .772 / .680, coverage .890 / .746 (unparaphrased / paraphrased)`."""
  return ", ".join(
      f"{e} " + " / ".join(f"{PAPER_TABLE1[(sl, e)][detector]:.3f}".lstrip("0")
                           for sl in ("unparaphrased", "paraphrased"))
      for e in ERRORS) + " (Table 1, synthetic unparaphrased / paraphrased)"


PAPER = {"rouge": "ROUGE-1 detects both error types above chance: " + _paper_figures("rouge"),
         "salience": "salience detects both above chance: " + _paper_figures("salience"),
         "classifier": "the YES/NO classifiers detect both above chance: "
                       + _paper_figures("classifier"),
         CONTROL: "not a detector: what the input's length alone gives (a synthetic "
                  "hallucination removes an argument, a coverage error adds one)",
         IMBALANCE_CONTROL: "not a detector: what |#pro - #con| alone gives (1.0 when every "
                            "error-free example is balanced: see balanced_sides)",
         COUNT_CONTROL: "not a detector: the template response's points per side (counted "
                        "from its lead phrases) against the input's arguments per side"}

# The nulls every detector's claim is measured against, in the same run on the same examples
# (`null_detections`): the same detector on a randomly initialised model of the base's config,
# never trained (`detect.build_untrained_detector`; ROUGE-1 has no model), and the length of
# what it reads, in content words: the generator's input, the classifiers' input (which holds
# the response too), the response. Each length null takes, per error type, the sign that ranks
# the examples best (the strongest a length alone can do).
UNTRAINED = "untrained model"
INPUT_LENGTH = "input length"
CLASSIFIER_INPUT_LENGTH = "classifier input length"
RESPONSE_LENGTH = "response length"
NULLS = {"rouge": (INPUT_LENGTH, RESPONSE_LENGTH),
         "salience": (UNTRAINED, INPUT_LENGTH, RESPONSE_LENGTH),
         "classifier": (UNTRAINED, INPUT_LENGTH, CLASSIFIER_INPUT_LENGTH, RESPONSE_LENGTH)}

# The paper's ordering (its Table 1, on the synthetic slices): classifiers trained on
# synthetic errors detect both error types best. Each pair: (better, worse).
PAPER_ORDER = (("classifier", "rouge"), ("classifier", "salience"))
PAPER_ORDER_DETECTORS = ("rouge", "salience", "classifier")
SLICE_ORDER = ("unparaphrased", "paraphrased")  # synthetic.SLICES, without importing it
ORDER_CLAIM = ("the trained classifiers detect both error types better than ROUGE-1 and "
               "salience (Table 1: .977-.998 against at most .772 / .890 unparaphrased and "
               ".708 / .831 paraphrased), and beyond their nulls")


def _slice_rank(name: str) -> tuple[int, str]:
  """The report's slice order, also for results read back from their key-sorted JSON."""
  return (SLICE_ORDER.index(name) if name in SLICE_ORDER else len(SLICE_ORDER), name)


def _detector_rank(name: str) -> tuple[int, str]:
  """The report's detector order: the paper's detectors, then the controls."""
  return (list(PAPER).index(name) if name in PAPER else len(PAPER), name)


def auc_intervals(examples: Sequence[Any], detections: Sequence[Any], *, num_resamples: int,
                  seed: int) -> dict[str, dict[str, Any]]:
  """{error: {level: {estimate, low, high, n, positives} or None}} for one detector, slice."""
  from jaxmoral import metrics  # pylint: disable=import-outside-toplevel
  from jaxmoral.npov import evaluate  # pylint: disable=import-outside-toplevel
  evaluated = evaluate.evaluate_slice(examples, detections)
  out: dict[str, dict[str, Any]] = {}
  for error in ERRORS:
    out[error] = {}
    labels = np.asarray(evaluated[error]["labels"], int)
    scores = np.asarray(evaluated[error]["scores"], np.float64)
    w_labels, w_scores, w_units = evaluate.word_arrays(examples, detections, error)
    # Examples are resampled one by one, all resamples in one call (`vectorized`); words by
    # whole examples, whose word counts differ: a call per resample.
    for level, metric, arrays, units, vectorized in (
        ("example", metrics.roc_auc_rows, (labels, scores), None, True),
        ("word", metrics.roc_auc, (w_labels, w_scores), w_units, False),
        ("word_within", metrics.grouped_roc_auc, (w_labels, w_scores, w_units),
         w_units, False)):
      if arrays[0].size == 0 or len(set(arrays[0].tolist())) < 2:
        out[error][level] = None
        continue
      try:
        ci = metrics.bootstrap_ci(metric, *arrays, units=units, num_resamples=num_resamples,
                                  seed=seed, vectorized=vectorized)
      except ValueError:  # No example holds both labels (within-example AUC undefined).
        out[error][level] = None
        continue
      out[error][level] = {**common.ci_dict(ci), "n": int(arrays[0].size),
                           "positives": int(arrays[0].sum())}
    # The library's own number, for the check that both agree.
    out[error]["library_example_auc"] = evaluated[error]["example_auc"]
  return out


def ordering_intervals(examples: Sequence[Any], better: Sequence[Any], worse: Sequence[Any],
                       *, num_resamples: int, seed: int) -> dict[str, Optional[dict[str, Any]]]:
  """{error: paired interval of ROC AUC(better) - ROC AUC(worse) at example level, or None}:
  two detectors' detections of the same `examples`, resampled together."""
  from jaxmoral import metrics  # pylint: disable=import-outside-toplevel
  from jaxmoral.npov import evaluate  # pylint: disable=import-outside-toplevel
  a, b = evaluate.evaluate_slice(examples, better), evaluate.evaluate_slice(examples, worse)
  out: dict[str, Optional[dict[str, Any]]] = {}
  for error in ERRORS:
    labels = np.asarray(a[error]["labels"], int)
    if labels.size == 0 or len(set(labels.tolist())) < 2:
      out[error] = None
      continue
    ci = metrics.bootstrap_ci(
        metrics.roc_auc_difference_rows, labels, np.asarray(a[error]["scores"], np.float64),
        np.asarray(b[error]["scores"], np.float64),
        num_resamples=num_resamples, seed=seed, vectorized=True)
    out[error] = {**common.ci_dict(ci), "n": int(labels.size)}
  return out


def paper_ordering(slices: Mapping[str, Sequence[Any]],
                   kept: Mapping[str, Mapping[str, tuple[Any, Sequence[Any]]]], *,
                   num_resamples: int, seed: int) -> dict[str, Any]:
  """{"better - worse": {slice: `ordering_intervals`}} for the pairs of `PAPER_ORDER` whose
  detectors both ran.

  Args:
    slices: {slice: its examples}.
    kept: {detector: {slice: (sorted indices of the examples it scored, its detections of
      them)}}; salience scores a sample, and each pair is compared on the examples both
      scored.
    num_resamples: Bootstrap resamples.
    seed: Bootstrap seed.
  """
  out: dict[str, Any] = {}
  for better, worse in PAPER_ORDER:
    if better not in kept or worse not in kept:
      continue
    out[f"{better} - {worse}"] = {}
    for slice_name, examples in slices.items():
      (idx_a, det_a), (idx_b, det_b) = kept[better][slice_name], kept[worse][slice_name]
      both = np.intersect1d(idx_a, idx_b)
      pick = lambda idx, dets: [dets[int(np.searchsorted(idx, i))]  # noqa: E731
                                for i in both]
      out[f"{better} - {worse}"][slice_name] = ordering_intervals(
          [examples[int(i)] for i in both], pick(idx_a, det_a), pick(idx_b, det_b),
          num_resamples=num_resamples, seed=seed)
  return out


def input_words(example: Any) -> int:
  """Content words of the generator's input (query and arguments): `evaluate.input_words`."""
  from jaxmoral.npov import evaluate  # pylint: disable=import-outside-toplevel
  return evaluate.input_words(example)


def length_detections(examples: Sequence[Any]) -> list[Any]:
  """The control's scores: hallucination = shorter input, coverage error = longer input."""
  from jaxmoral.npov import evaluate  # pylint: disable=import-outside-toplevel
  return evaluate.input_length_detections(examples)


def imbalance_detections(examples: Sequence[Any]) -> list[Any]:
  """The side-balance control: |#pro - #con| as the score of both error types."""
  from jaxmoral.npov.detectors import base  # pylint: disable=import-outside-toplevel
  gaps = [float(abs(len(e.pro) - len(e.con))) for e in examples]
  return [base.Detection(gap, gap) for gap in gaps]


def count_detections(examples: Sequence[Any]) -> list[Any]:
  """The point-count control: per side, the response's points beyond the input's arguments
  (hallucination) and the arguments beyond its points (coverage), summed over the sides.

  The synthetic errors keep the template response and remove or add one argument, so on
  template responses this count tells every error apart without reading a word of content.
  """
  from jaxmoral.npov import task  # pylint: disable=import-outside-toplevel
  from jaxmoral.npov.detectors import base  # pylint: disable=import-outside-toplevel
  out = []
  for e in examples:
    points = task.template_points(e.response)
    given = {side: len(getattr(e, side)) for side in task.SIDES}
    out.append(base.Detection(
        float(sum(max(0, points[s] - given[s]) for s in task.SIDES)),
        float(sum(max(0, given[s] - points[s]) for s in task.SIDES))))
  return out


CONTROL_DETECTIONS = {CONTROL: length_detections, IMBALANCE_CONTROL: imbalance_detections,
                      COUNT_CONTROL: count_detections}
CONTROLS = tuple(CONTROL_DETECTIONS)


def response_words(example: Any) -> int:
  """Content words of the response."""
  from jaxmoral.npov import text as text_lib  # pylint: disable=import-outside-toplevel
  return sum(not w.is_stopword for w in text_lib.words(example.response))


def classifier_input_words(example: Any) -> int:
  """Content words of the classifiers' input (query, arguments and response)."""
  from jaxmoral.npov import task  # pylint: disable=import-outside-toplevel
  from jaxmoral.npov import text as text_lib  # pylint: disable=import-outside-toplevel
  return sum(not w.is_stopword for w in text_lib.words(task.format_classifier_input(example)))


LENGTH_NULLS = {INPUT_LENGTH: input_words, CLASSIFIER_INPUT_LENGTH: classifier_input_words,
                RESPONSE_LENGTH: response_words}


def oriented_length_detections(examples: Sequence[Any], counts: Sequence[float]) -> list[Any]:
  """A length as both error scores, each with the sign under which it ranks `examples`' errors
  best (ROC AUC >= 0.5 on the examples that error's AUC uses): the strongest null a length
  gives, so a detector must beat it whichever way the length runs."""
  from jaxmoral import metrics  # pylint: disable=import-outside-toplevel
  from jaxmoral.npov.detectors import base  # pylint: disable=import-outside-toplevel
  n = np.asarray(counts, np.float64)
  sign = {}
  for error in ERRORS:
    other = ERRORS[1 - ERRORS.index(error)]
    chosen = [i for i, e in enumerate(examples)
              if getattr(e, error) is not None and not getattr(e, other)]
    labels = [int(getattr(examples[i], error)) for i in chosen]
    sign[error] = (-1.0 if len(set(labels)) == 2 and metrics.roc_auc(labels, n[chosen]) < 0.5
                   else 1.0)
  return [base.Detection(sign["hallucination"] * x, sign["coverage"] * x) for x in n]


def null_detections(detector: str, examples: Sequence[Any],
                    untrained: Optional[Sequence[Any]] = None) -> dict[str, list[Any]]:
  """{null: its detections of `examples`} for the nulls `NULLS[detector]` names: the lengths
  computed here, the untrained model's from `untrained` (its detections of the same examples;
  left out when None)."""
  out: dict[str, list[Any]] = {}
  for null in NULLS[detector]:
    if null == UNTRAINED:
      if untrained is not None:
        out[null] = list(untrained)
    else:
      out[null] = oriented_length_detections(examples, [LENGTH_NULLS[null](e) for e in examples])
  return out


def null_intervals(examples: Sequence[Any], detections: Sequence[Any],
                   nulls: Mapping[str, Sequence[Any]], *, num_resamples: int, seed: int
                   ) -> dict[str, dict[str, Any]]:
  """{null: {"auc": {error: the null's example-level ROC AUC interval or None},
  "difference": {error: the paired interval of the detector's AUC minus the null's, the same
  examples resampled together, or None}}} for one detector on one slice."""
  out: dict[str, dict[str, Any]] = {}
  for null, null_dets in nulls.items():
    auc = auc_intervals(examples, null_dets, num_resamples=num_resamples, seed=seed)
    out[null] = {"auc": {e: auc[e]["example"] for e in ERRORS},
                 "difference": ordering_intervals(examples, detections, null_dets,
                                                  num_resamples=num_resamples, seed=seed)}
  return out


def substitution_examples(sources: Sequence[Any], topics: Sequence[Any], *, seed: int
                          ) -> list[Any]:
  """Pairs (error-free source, its substitution variant), flattened, for sources that have
  one: the probe's examples."""
  from jaxmoral.npov import synthetic  # pylint: disable=import-outside-toplevel
  by_id = {t.id: t for t in topics}
  rng = np.random.default_rng(seed)
  out = []
  for e in sources:
    swapped = synthetic.make_substitution(e, by_id[e.topic], rng)
    if swapped is not None:
      out += [e.replace(hallucination=False, coverage=False), swapped]
  return out


def substitution_auc(examples: Sequence[Any], detections: Sequence[Any], *,
                     num_resamples: int, seed: int) -> dict[str, dict[str, Any]]:
  """{error: interval}: ROC AUC of that error's score, substituted (positive) vs clean; pairs
  are resampled whole."""
  from jaxmoral import metrics  # pylint: disable=import-outside-toplevel
  labels = np.array([int(e.hallucination) for e in examples])
  units = np.arange(len(examples)) // 2
  out = {}
  for error in ERRORS:
    scores = np.array([getattr(d, error) for d in detections], np.float64)
    ci = metrics.bootstrap_ci(metrics.roc_auc_rows, labels, scores, units=units,
                              num_resamples=num_resamples, seed=seed, vectorized=True)
    out[error] = {**common.ci_dict(ci), "n": int(labels.size), "positives": int(labels.sum())}
  return out


def length_matched_auc(labels: Any, scores: Any, lengths: Any) -> float:
  """ROC AUC over the (error, clean) pairs whose inputs have the same length
  (`metrics.grouped_roc_auc`): what a score tells beyond length (one that only follows
  length gets exactly 0.5).

  Raises:
    ValueError: No length holds both an error and a clean example.
  """
  from jaxmoral import metrics  # pylint: disable=import-outside-toplevel
  return metrics.grouped_roc_auc(labels, scores, lengths)


def length_dependence(examples: Sequence[Any], detections: Sequence[Any], *,
                      num_resamples: int, seed: int) -> dict[str, Optional[dict[str, Any]]]:
  """Per error, on the examples its ROC AUC uses: the Spearman correlation of the example
  score with the input's length (content words), and `length_matched_auc` with its interval."""
  import scipy.stats  # pylint: disable=import-outside-toplevel
  from jaxmoral import metrics  # pylint: disable=import-outside-toplevel
  out: dict[str, Optional[dict[str, Any]]] = {}
  for error in ERRORS:
    other = ERRORS[1 - ERRORS.index(error)]
    chosen = [(e, d) for e, d in zip(examples, detections)
              if getattr(e, error) is not None and not getattr(e, other)]
    labels = np.asarray([int(getattr(e, error)) for e, _ in chosen])
    scores = np.asarray([getattr(d, error) for _, d in chosen], np.float64)
    lengths = np.asarray([input_words(e) for e, _ in chosen])
    try:
      ci = metrics.bootstrap_ci(length_matched_auc, labels, scores, lengths,
                                num_resamples=num_resamples, seed=seed)
    except ValueError:  # One label only, or no length with both.
      out[error] = None
      continue
    constant = np.ptp(scores) == 0 or np.ptp(lengths) == 0  # no correlation defined
    out[error] = {"spearman": None if constant else float(
                      scipy.stats.spearmanr(scores, lengths)[0]),
                  "length_matched_auc": common.ci_dict(ci)}
  return out


def classifier_run_name(error: str, *, tuning: str, balanced_sides: bool,
                        substitutions: bool) -> str:
  """The workdir folder of one classifier run: each training setting has its own, so runs of
  several settings share a workdir (and its base and generator) without resuming each other."""
  return "_".join(["classifier", *(["full"] if tuning == "full" else []),
                   *([] if balanced_sides else ["unbalanced"]),
                   *(["substituted"] if substitutions else []), error])


def _distinct(examples: Sequence[Any]) -> list[Any]:
  """Each (claim, pro, con) once: several argument subsets of a claim may coincide."""
  seen: dict[tuple[Any, ...], Any] = {}
  for e in examples:
    seen.setdefault((e.topic, e.pro, e.con), e)
  return list(seen.values())


def heldout_sources(topics: Sequence[Any], *, seed: int, examples_per_claim: int,
                    max_per_side: int, balanced_sides: bool, max_sources: Optional[int]
                    ) -> list[Any]:
  """The error-free source examples of the test claims, as `run_experiment` draws them."""
  from jaxmoral.npov import knowledge_base as kb_lib  # pylint: disable=import-outside-toplevel
  sources = _distinct(kb_lib.sample_examples(topics, seed=seed + 1, split="test",
                                             examples_per_topic=examples_per_claim,
                                             max_per_side=max_per_side,
                                             same_count_per_side=balanced_sides))
  return sources[:max_sources] if max_sources else sources


def salience_indices(size: int, max_examples: Optional[int], *, seed: int) -> np.ndarray:
  """The seeded sample of example indices salience scores (the same in both slices)."""
  return np.sort(np.random.default_rng(seed + 4).choice(
      size, size=min(size, max_examples or size), replace=False))


@gin.configurable(module="npov_table1")
def run_null_check(*, results_dir: str, name: str, model_config: Any, vocabulary_path: str,
                   perspectrum_dir: str, test_examples_per_claim: int = 1,
                   max_per_side: int = 3, max_test_sources: Optional[int] = None,
                   balanced_sides: bool = True, max_salience_examples: Optional[int] = None,
                   slices: Sequence[str] = ("unparaphrased", "paraphrased"),
                   prompt_length: Optional[int] = 5,
                   untrained: Sequence[str] = ("salience", "classifier"),
                   num_resamples: int = 1000, seed: int = 0, command: str = ""
                   ) -> dict[str, Any]:
  """The nulls alone on `run_experiment`'s test examples, without training anything: ROUGE-1
  against its length nulls, and the model-based detectors on an untrained model of
  `model_config` (with the base's vocabulary) scored as detectors against the length nulls:
  what a verdict must beat, measured where no trained base is at hand.

  Args:
    results_dir: Where `<name>.md/.json/.png` go.
    name: Name of the result files.
    model_config: The base's T5Config (MODEL_CONFIG).
    vocabulary_path: The base's SentencePiece model.
    perspectrum_dir: PERSPECTRUM's folder.
    test_examples_per_claim, max_per_side, max_test_sources, balanced_sides,
      max_salience_examples, num_resamples, seed: As `run_experiment`'s (the same examples).
    slices: The test slices scored.
    prompt_length: The trained detectors' soft prompt length (`prompt_tuning.PromptConfig`'s
      default): the untrained ones carry an untrained prompt of it.
    untrained: The model-based detectors run on the untrained model.
    command: The command line (written into the report).
  """
  # pylint: disable=import-outside-toplevel
  from jaxmoral import model_dirs
  from jaxmoral.npov import detect
  from jaxmoral.npov import knowledge_base as kb_lib
  from jaxmoral.npov import synthetic
  from jaxmoral.npov.detectors import rouge
  # pylint: enable=import-outside-toplevel
  started = time.time()
  topics = kb_lib.read_perspectrum(perspectrum_dir)
  sources = heldout_sources(topics, seed=seed, examples_per_claim=test_examples_per_claim,
                            max_per_side=max_per_side, balanced_sides=balanced_sides,
                            max_sources=max_test_sources)
  test_slices = {k: v for k, v in synthetic.make_test_slices(sources, topics,
                                                              seed=seed + 3).items()
                 if k in slices}
  sample = salience_indices(len(next(iter(test_slices.values()))), max_salience_examples,
                            seed=seed)
  vocabulary = model_dirs.vocabulary_from_file(vocabulary_path)
  detectors = {"rouge": rouge.RougeDetector(), **{
      f"untrained {d}": detect.build_untrained_detector(d, config=model_config,
                                                        vocabulary=vocabulary, seed=seed + 8,
                                                        prompt_length=prompt_length)
      for d in untrained}}
  results: dict[str, Any] = {"auc": {}, "nulls": {}, "length": {},
                             "slices": {k: len(v) for k, v in test_slices.items()}}
  timings: dict[str, float] = {}
  for det_name, det in detectors.items():
    tick = time.time()
    kind = det_name.split()[-1]
    for sl, examples in test_slices.items():
      if kind == "salience":
        examples = [examples[i] for i in sample]
      detections = det.detect_batch(examples)
      results["auc"].setdefault(det_name, {})[sl] = auc_intervals(
          examples, detections, num_resamples=num_resamples, seed=seed)
      results["length"].setdefault(det_name, {})[sl] = length_dependence(
          examples, detections, num_resamples=num_resamples, seed=seed)
      lengths = {n: d for n, d in null_detections(kind, examples).items()}
      results["nulls"].setdefault(det_name, {})[sl] = null_intervals(
          examples, detections, lengths, num_resamples=num_resamples, seed=seed)
    timings[f"{det_name.replace(' ', '_')}_s"] = time.time() - tick
  timings["total_s"] = time.time() - started
  results.update({"command": command, "machine": common.machine(), "timings": timings,
                  "setup": {"model_config": repr(model_config), "vocabulary": vocabulary_path,
                            "test_sources": len(sources),
                            "salience_examples_per_slice": int(len(sample)),
                            "num_resamples": num_resamples, "seed": seed}})
  return common.write_results(results, results_dir=results_dir, name=name,
                              title=f"NPOV nulls ({name})", plot=plot, report=null_report)


def null_report(results: Mapping[str, Any], *, name: str) -> str:
  """The Markdown of `run_null_check`: every score's example-level ROC AUC, its length-matched
  and within-example word AUC, and its difference from each length null."""
  t, setup = results["timings"], results["setup"]
  slices = list(results["slices"])
  lines = [*common.report_head(results, name=name),
           f"No model is trained: {setup['test_sources']} error-free test sources -> "
           + ", ".join(f"{k} {v}" for k, v in results["slices"].items()) + " examples"
           + (f" (the untrained salience on a seeded {setup['salience_examples_per_slice']} "
              "per slice)" if "untrained salience" in results["auc"] else "")
           + f"; the untrained model: {setup['model_config']}, randomly initialised "
           f"(seed + 8), vocabulary `{setup['vocabulary']}`. ROC AUC with 95 % bootstrap "
           f"intervals ({setup['num_resamples']} resamples).", "",
           "| score | slice | error | ROC AUC | length-matched | word | word within example |"
           + " Δ input length | Δ response length |", "|---|---|---|---|---|---|---|---|---|"]
  for det, by_slice in results["auc"].items():
    for sl in slices:
      for e in ERRORS:
        a = by_slice[sl][e]
        length = (results["length"][det][sl] or {}).get(e) or {}
        nulls = results["nulls"][det][sl]
        lines.append(f"| {det} | {sl} | {e} | {common.fmt(a['example'])} | "
                     f"{common.fmt(length.get('length_matched_auc'))} | "
                     f"{common.fmt(a.get('word'))} | {common.fmt(a.get('word_within'))} | "
                     + " | ".join(common.fmt((nulls.get(n) or {}).get("difference", {}).get(e))
                                  for n in (INPUT_LENGTH, RESPONSE_LENGTH)) + " |")
  lines += ["", "Length nulls alone (ROC AUC, each with its stronger sign):", ""]
  for sl in slices:
    first = next(iter(results["nulls"].values()))[sl]
    lines.append(f"- {sl}: " + "; ".join(
        f"{n}: " + ", ".join(f"{e} {common.fmt(first[n]['auc'][e])}" for e in ERRORS)
        for n in (INPUT_LENGTH, RESPONSE_LENGTH)))
  lines += ["", "Seconds: " + ", ".join(f"{k[:-2]} {v:.0f}" for k, v in t.items()) + ".", "",
            f"Plot: `{results['plot']}`."]
  return "\n".join(lines)


@gin.configurable(module="npov_table1")
def run_experiment(*, workdir: str, results_dir: str, name: str, init_checkpoint: str,
                   model_config: Any, optimizer: Any, perspectrum_dir: str,
                   train_examples_per_claim: int = 4, test_examples_per_claim: int = 1,
                   max_per_side: int = 3, max_test_sources: Optional[int] = None,
                   base_steps: int = 600, prompt_steps: int = 300, classifier_steps: int = 300,
                   classifier_tuning: str = "prompt", balanced_sides: bool = True,
                   classifier_substitutions: bool = False, substitution_probe: bool = False,
                   prompt_learning_rate: float = 0.3, warmup_steps: int = 50,
                   batch_size: int = 16, pack_base: bool = False,
                   feature_lengths: Optional[Mapping[str, int]] = None,
                   detectors: Sequence[str] = ("rouge", "salience", "classifier"),
                   max_salience_examples: Optional[int] = None, num_resamples: int = 1000,
                   log_every: int = 50, checkpoints_per_stage: int = 10, seed: int = 0,
                   command: str = "") -> dict[str, Any]:
  """Runs the whole experiment; writes and returns the results.

  Args:
    workdir: Runs and data files (WORKDIR).
    results_dir: Where `<name>.md/.json/.png` go (RESULTS_DIR).
    name: Name of the result files (NAME).
    init_checkpoint: The pretrained base (INIT_CHECKPOINT).
    model_config: Its T5Config (MODEL_CONFIG).
    optimizer: Optimizer of the base fine-tuning (OPTIMIZER).
    perspectrum_dir: PERSPECTRUM's folder (claims, perspectives, split file).
    train_examples_per_claim: Verbalisation examples (argument subsets) per train claim.
    test_examples_per_claim: Error-free source examples per test claim (each gives a clean,
      a hallucination and a coverage example per slice).
    max_per_side: Arguments per side at most.
    max_test_sources: Cap on test source examples (None: all).
    base_steps: Fine-tuning steps of the base on the verbalisation task.
    prompt_steps: Generator soft-prompt steps.
    classifier_steps: Training steps of each classifier.
    classifier_tuning: "prompt" (the paper: a soft prompt on the frozen base, at the prompts'
      learning rate) or "full" (ablation: every weight fine-tuned, with `optimizer`). Each
      classifier setting (this, `balanced_sides`, `classifier_substitutions`) trains into a
      folder of its own (`classifier_run_name`), so all share the workdir's base and generator.
    balanced_sides: Error-free test and classifier-training sources have as many arguments on
      each side (as the configs of record use). A synthetic error then always unbalances the
      sides, a cue that tells every error apart (the `side_imbalance` control scores 1.0). False samples
      each side's count on its own for those sources; the generator's verbalisation examples
      stay balanced either way, so the base and generator runs are shared.
    classifier_substitutions: Add each classifier-training source's
      `synthetic.make_substitution` variant (unparaphrased and paraphrased) to the classifiers'
      training mix, a positive example for both: with clean, hallucinated and covered examples
      only, counting the response's points against the input's arguments tells every label
      (the `point_count` control scores 1.0), and substitutions are where it does not.
    substitution_probe: Also score each unparaphrased error-free test example against its
      `synthetic.make_substitution` variant (one argument swapped for an unused one: both
      errors, the counts unchanged): ROC AUC of each detector's hallucination and coverage
      scores, substituted vs clean, in `results["substitution"]`. A detector that only counts
      arguments against the response's points scores 0.5 here. Salience (a backward pass per
      chunk) scores the first `max_salience_examples` pairs of them.
    prompt_learning_rate: Peak learning rate of the prompts (paper's optimizer).
    warmup_steps: Prompt warm-up steps.
    batch_size: Batch size of every run.
    pack_base: Pack several verbalisation examples per row when fine-tuning the base (T5X's
      packing): the median example fills a third of a 192-token row; packed rows of 192 hold
      1.8 examples on average, read at the same cost per step. The prompt stages cannot pack
      (one soft prompt per row).
    feature_lengths: Generator input / response tokens (classifiers read both); default
      256 / 256.
    detectors: Any of "rouge", "salience", "classifier".
    max_salience_examples: Salience (a backward pass per chunk of response tokens) runs on
      this many examples of each slice at most, a seeded sample, the same source examples in
      both slices (None: all).
    num_resamples: Bootstrap resamples.
    log_every: Training progress lines.
    checkpoints_per_stage: Checkpoints of each training stage, the last at its end (a
      stopped experiment resumes from the newest).
    seed: Sampling, training and bootstrap seed.
    command: The command line (written into the report).

  Returns:
    Every number of the report (also in `<results_dir>/<name>.json`).
  """
  # pylint: disable=import-outside-toplevel
  from jaxmoral import model_dirs
  from jaxmoral import prompt_tuning
  from jaxmoral import runs
  from jaxmoral.data import readers
  from jaxmoral.models import trainable
  from jaxmoral.npov import detect
  from jaxmoral.npov import knowledge_base as kb_lib
  from jaxmoral.npov import synthetic
  from jaxmoral.npov import task
  from jaxmoral.npov.detectors import classifier
  # pylint: enable=import-outside-toplevel
  if classifier_tuning not in classifier.TUNINGS:  # Before hours of training, not after.
    raise ValueError(f"npov_table1.run_experiment.classifier_tuning must be one of "
                     f"{classifier.TUNINGS}, got {classifier_tuning!r}")
  started = time.time()
  common.fileio.makedirs(workdir)  # A local folder or a bucket URL.
  timings: dict[str, float] = {}
  topics = kb_lib.read_perspectrum(perspectrum_dir)
  by_split = {s: sum(t.split == s for t in topics) for s in ("train", "dev", "test")}
  train_examples = kb_lib.sample_examples(topics, seed=seed, split="train",
                                          examples_per_topic=train_examples_per_claim,
                                          max_per_side=max_per_side)
  train_examples = _distinct(train_examples)
  test_sources = heldout_sources(topics, seed=seed, examples_per_claim=test_examples_per_claim,
                                 max_per_side=max_per_side, balanced_sides=balanced_sides,
                                 max_sources=max_test_sources)
  logger.info("perspectrum: %s claims by split; %d train verbalisation examples; %d test "
              "source examples", by_split, len(train_examples), len(test_sources))
  pairs = readers.write_jsonl(os.path.join(workdir, "data", "generator.jsonl"),
                              ({"inputs": task.format_input(e), "targets": e.response}
                               for e in train_examples))
  feature_lengths = feature_lengths or {"inputs": 256, "targets": 256}
  lengths = {"inputs": int(feature_lengths["inputs"]), "targets": int(feature_lengths["targets"])}
  common_run = dict(batch_size=batch_size, seed=seed, log_every=log_every)
  prompt_optimizer = lambda steps: prompt_tuning.paper_optimizer(  # noqa: E731
      train_steps=steps, learning_rate=prompt_learning_rate, warmup_steps=warmup_steps)

  # 1. The base fine-tuned on verbalisation, then the generator and classifier prompts on it.
  base_dir = os.path.join(workdir, "base")
  stages = {"base": common.train_stage(base_dir, base_steps, lambda: runs.train_run(
      model_dir=base_dir, model=trainable.Seq2SeqModel(config=model_config),
      data=runs.Seq2SeqData(train_file=pairs, pack=pack_base), train_steps=base_steps,
      feature_lengths=lengths,
      checkpoint_every=common.checkpoint_every(base_steps, saves=checkpoints_per_stage),
      optimizer=optimizer, init_checkpoint=init_checkpoint,
      **common_run))}
  generator_dir = os.path.join(workdir, "generator")
  stages["generator"] = common.train_stage(
      generator_dir, prompt_steps, lambda: runs.train_run(
          model_dir=generator_dir, model=prompt_tuning.PromptTuningModel(
              config=model_config,
              prompt=prompt_tuning.PromptConfig(
                  vocab_sample_size=min(5000, model_config.vocab_size)),
              metadata={"task": "npov_generator"}),
          data=runs.Seq2SeqData(train_file=pairs), train_steps=prompt_steps,
          feature_lengths=lengths,
          checkpoint_every=common.checkpoint_every(prompt_steps, saves=checkpoints_per_stage),
          optimizer=prompt_optimizer(prompt_steps), init_checkpoint=base_dir,
          **common_run))
  timings["base_train_s"] = stages["base"]["seconds"]
  timings["generator_prompt_s"] = stages["generator"]["seconds"]
  # How well the generator copies its arguments (the task is nearly verbatim copying):
  # salience can only point at sources a generator actually uses.
  token_accuracy = {k: v["result"].get("eval/accuracy") for k, v in stages.items()}
  classifier_sources = train_examples if balanced_sides else _distinct(kb_lib.sample_examples(
      topics, seed=seed, split="train", examples_per_topic=train_examples_per_claim,
      max_per_side=max_per_side, same_count_per_side=False))
  train_synthetic = synthetic.training_examples(classifier_sources, topics, seed=seed + 2)
  if classifier_substitutions:
    swapped = substitution_examples(classifier_sources, topics, seed=seed + 6)[1::2]
    rng, by_id = np.random.default_rng(seed + 7), {t.id: t for t in topics}
    train_synthetic += swapped + [synthetic.paraphrase(e, by_id[e.topic], rng) for e in swapped]
  classifier_dirs = {}
  classifier_optimizer = (optimizer if classifier_tuning == "full"
                          else prompt_optimizer(classifier_steps))
  for error in classifier.ERROR_TYPES:
    classifier_dirs[error] = os.path.join(workdir, classifier_run_name(
        error, tuning=classifier_tuning, balanced_sides=balanced_sides,
        substitutions=classifier_substitutions))
    timings[f"classifier_{error}_s"] = common.train_stage(
        classifier_dirs[error], classifier_steps, lambda e=error: classifier.train_classifier(
            model_dir=classifier_dirs[e], base_dir=base_dir, examples=train_synthetic, error=e,
            train_steps=classifier_steps, optimizer=classifier_optimizer,
            tuning=classifier_tuning, max_input_length=lengths["inputs"] + lengths["targets"],
            checkpoint_every=common.checkpoint_every(classifier_steps,
                                                     saves=checkpoints_per_stage),
            **common_run))["seconds"]

  # 2. Synthetic errors of the held-out claims; 3. every detector on both slices.
  test_slices = synthetic.make_test_slices(test_sources, topics, seed=seed + 3)
  results: dict[str, Any] = {"auc": {}, "length": {}, "nulls": {},
                             "slices": {k: len(v) for k, v in test_slices.items()}}
  base_info = model_dirs.inspect(base_dir)  # The untrained nulls' config and vocabulary.
  # Slices are aligned (example i of "paraphrased" paraphrases example i of "unparaphrased").
  salience_sample = salience_indices(len(test_slices["unparaphrased"]), max_salience_examples,
                                     seed=seed)
  probe_examples = substitution_examples(test_sources, topics, seed=seed + 5) if (
      substitution_probe) else []
  if probe_examples:
    results["substitution"] = {}
  # {detector: {slice: (example indices of the slice, their detections)}}, for the ordering.
  kept: dict[str, dict[str, tuple[Any, list[Any]]]] = {}
  for det_name in (*detectors, *CONTROLS):
    tick = time.time()
    built = None if det_name in CONTROL_DETECTIONS else detect.build_detector(
        det_name, base_dir=base_dir,
        generator_dir=generator_dir if det_name == "salience" else None,
        classifier_dirs=classifier_dirs)
    detect_batch = CONTROL_DETECTIONS.get(det_name) or built.detect_batch
    if probe_examples:
      examples = (probe_examples if det_name != "salience" or not max_salience_examples else
                  probe_examples[:2 * max_salience_examples])
      results["substitution"][det_name] = substitution_auc(
          examples, detect_batch(examples), num_resamples=num_resamples, seed=seed)
      logger.info("%s on substitutions: %s", det_name, {
          e: v["estimate"] for e, v in results["substitution"][det_name].items()})
    results["auc"][det_name], results["length"][det_name] = {}, {}
    untrained = (detect.build_untrained_detector(det_name, config=base_info.config,
                                                 vocabulary=base_info.vocabulary,
                                                 seed=seed + 8,
                                                 prompt_length=detect.prompt_length(built))
                 if UNTRAINED in NULLS.get(det_name, ()) else None)
    for slice_name, examples in test_slices.items():
      indices = np.arange(len(examples))
      if det_name == "salience" and max_salience_examples:
        indices = salience_sample
        examples = [examples[i] for i in salience_sample]
      detections = detect_batch(examples)
      if det_name not in CONTROLS:
        kept.setdefault(det_name, {})[slice_name] = (indices, detections)
      results["auc"][det_name][slice_name] = auc_intervals(
          examples, detections, num_resamples=num_resamples, seed=seed)
      results["length"][det_name][slice_name] = length_dependence(
          examples, detections, num_resamples=num_resamples, seed=seed)
      if det_name in NULLS:  # Its nulls on the same examples, in this run.
        results["nulls"].setdefault(det_name, {})[slice_name] = null_intervals(
            examples, detections, null_detections(
                det_name, examples, untrained.detect_batch(examples) if untrained else None),
            num_resamples=num_resamples, seed=seed)
      logger.info("%s on %s: %s", det_name, slice_name, {
          e: v["example"]["estimate"] if v["example"] else None
          for e, v in results["auc"][det_name][slice_name].items()})
    if det_name not in CONTROLS:
      timings[f"detect_{det_name}_s"] = time.time() - tick
  timings["total_s"] = time.time() - started
  results["ordering"] = paper_ordering(test_slices, kept, num_resamples=num_resamples,
                                       seed=seed)
  results["verdicts"] = verdicts(results["auc"], results["nulls"])
  results["ordering_verdicts"] = ordering_verdicts(results["ordering"], results["nulls"])
  results.update({
      "command": command, "machine": common.machine(), "timings": timings,
      "setup": {"init_checkpoint": init_checkpoint, "claims_by_split": by_split,
                "train_examples": len(train_examples),
                "classifier_train_examples": len(train_synthetic),
                "test_sources": len(test_sources), "base_steps": base_steps,
                "salience_examples_per_slice": int(len(salience_sample)),
                "heldout_token_accuracy": token_accuracy,
                "prompt_steps": prompt_steps, "classifier_steps": classifier_steps,
                "classifier_tuning": classifier_tuning, "balanced_sides": balanced_sides,
                "classifier_substitutions": classifier_substitutions,
                "batch_size": batch_size, "pack_base": pack_base, "feature_lengths": lengths,
                "seed": seed,
                "num_resamples": num_resamples}})
  return common.write_results(results, results_dir=results_dir, name=name,
                              title=f"NPOV Table 1 shape ({name})", plot=plot, report=report)


def _null_difference(nulls: Optional[Mapping[str, Any]], det: str, slice_name: str, null: str,
                     error: str) -> Optional[Mapping[str, float]]:
  """The paired interval of `det`'s ROC AUC minus `null`'s on one slice (None: not measured)."""
  found = (((nulls or {}).get(det) or {}).get(slice_name) or {}).get(null) or {}
  return (found.get("difference") or {}).get(error)


def claim_parts(det: str, error: str, by_slice: Mapping[str, Any],
                nulls: Optional[Mapping[str, Any]]) -> list[Any]:
  """The claim "`det` detects `error`" as parts (`common.ClaimPart`), per test slice: the
  example-level ROC AUC above chance (0.5), and the paired interval of the AUC minus each of
  its nulls' (`NULLS[det]`, the same examples) above 0. A slice this run has no interval for
  (not built, or one class only) is left out; on a slice it measured, every null is
  required, so a run that did not measure one is not shown."""
  parts = []
  for sl in sorted(by_slice, key=_slice_rank):
    chance = by_slice[sl][error]["example"]
    parts.append(common.ClaimPart(f"{sl} ROC AUC", chance, baseline=0.5, required=False))
    parts += [common.ClaimPart(f"{sl} ROC AUC minus the {null}'s",
                               _null_difference(nulls, det, sl, null, error),
                               required=chance is not None, null=null)
              for null in NULLS.get(det, ())]
  return parts


def verdicts(auc: Mapping[str, Any], nulls: Optional[Mapping[str, Any]] = None
             ) -> dict[str, dict[str, dict[str, Any]]]:
  """{detector: {error: {"verdict", "why", "slices": {slice: status against chance}}}} by
  `common.claim_verdict` on `claim_parts` for the paper's detectors; for the controls, which
  claim nothing, only each slice's status against chance (verdict None).

  Args:
    auc: {detector: {slice: `auc_intervals`}}.
    nulls: {detector: {slice: `null_intervals`}} (None or absent: not measured, as in
      results written before the nulls were).
  """
  out: dict[str, dict[str, dict[str, Any]]] = {}
  for det, by_slice in auc.items():
    out[det] = {}
    slices = sorted(by_slice, key=_slice_rank)
    for error in ERRORS:
      chance = {sl: common.ClaimPart(f"{sl} ROC AUC", by_slice[sl][error]["example"],
                                     baseline=0.5).status for sl in slices}
      if det in NULLS:
        word, why = common.claim_verdict(claim_parts(det, error, by_slice, nulls))
      else:
        word, why = None, ""
      out[det][error] = {"verdict": word, "why": why, "slices": chance}
  return out


def ordering_verdicts(ordering: Mapping[str, Any], nulls: Optional[Mapping[str, Any]] = None
                      ) -> dict[str, dict[str, str]]:
  """{error: {"verdict", "why"}} for `ORDER_CLAIM` by `common.claim_verdict`: one part per
  pair of `PAPER_ORDER` and test slice, the paired ROC AUC difference's interval above 0
  (same examples), and on each of those slices the classifiers' AUC above each of their nulls
  (`NULLS["classifier"]`, required). A pair or slice this run did not measure is named and
  left out; with none measured (e.g. results written before the ordering was computed) it is
  not shown."""
  out = {}
  for error in ERRORS:
    parts, slices = [], {}
    for pair in (f"{a} - {b}" for a, b in PAPER_ORDER):
      by_slice = ordering.get(pair) or {"every slice": None}
      slices.update(dict.fromkeys(by_slice))
      parts += [common.ClaimPart(f"{pair} ROC AUC ({sl})", (by_slice[sl] or {}).get(error),
                                 required=False) for sl in sorted(by_slice, key=_slice_rank)]
    parts += [common.ClaimPart(f"classifier ROC AUC minus the {null}'s ({sl})",
                               _null_difference(nulls, "classifier", sl, null, error),
                               null=null)
              for sl in sorted(slices, key=_slice_rank) for null in NULLS["classifier"]]
    word, why = common.claim_verdict(parts)
    out[error] = {"verdict": word, "why": why}
  return out


def verdict_lines(results: Mapping[str, Any]) -> list[str]:
  """The claims, the rule and this run's verdicts (Markdown lines)."""
  lines = ["Claims, each tested by the rule below: every detector above chance (ROC AUC 0.5) "
           "and above each of its nulls (" + "; ".join(
               f"{d}: {', '.join(n)}" for d, n in NULLS.items()) + ": paired intervals of "
           "the AUC difference over the same examples) on each test slice, per error type, at "
           f"example level; and the paper's ordering: {ORDER_CLAIM} (paired intervals of the "
           "AUC difference over the same examples).", "", common.VERDICT_RULE, ""]
  for det in sorted(results["verdicts"], key=_detector_rank):
    by_error = results["verdicts"][det]
    if det in PAPER_ORDER_DETECTORS:
      found = "; ".join(f"{e} **{v['verdict']}** ({v['why']})" for e, v in by_error.items())
    else:  # A confound control: how far it separates errors, no claim of the paper's.
      words = {common.SHOWN: "above chance", common.CONTRADICTED: "below chance",
               common.NOT_SHOWN: "not above chance", common.NOT_MEASURED: "not measured"}
      found = "; ".join(f"{e}: " + ", ".join(f"{sl} {words[status]}" for sl, status in
                                             v["slices"].items()) for e, v in by_error.items())
    lines.append(f"- {det}: paper: {PAPER.get(det, '')}; this run: {found}.")
  ordering = results.get("ordering_verdicts") or ordering_verdicts(
      results.get("ordering", {}), results.get("nulls"))
  lines.append(f"- ordering: paper: {ORDER_CLAIM}; this run: " + "; ".join(
      f"{e} **{v['verdict']}** ({v['why']})" for e, v in ordering.items()) + ".")
  return lines


def report(results: Mapping[str, Any], *, name: str) -> str:
  """The Markdown section for bench/RESULTS.md."""
  s, t = results["setup"], results["timings"]
  slices = list(results["slices"])
  lines = [*common.report_head(results, name=name),
           f"Setup: base `{s['init_checkpoint']}`; PERSPECTRUM claims by split "
           f"{s['claims_by_split']}; {s['train_examples']} verbalisation examples of the train "
           f"claims (base fine-tuned {s['base_steps']} steps"
           f"{' of packed rows' if s.get('pack_base') else ''}, generator prompt "
           f"{s['prompt_steps']} steps, classifiers "
           f"{'fine-tuned' if s.get('classifier_tuning') == 'full' else 'prompt-tuned'} "
           f"{s['classifier_steps']} steps each on "
           f"{s['classifier_train_examples']} synthetic train examples"
           f"{', substitutions included' if s.get('classifier_substitutions') else ''}); "
           "error-free sources "
           + ("with as many arguments on each side" if s.get("balanced_sides", True) else
              "with each side's argument count drawn on its own (classifier training and test)")
           + "; test: "
           f"{s['test_sources']} source examples of the test claims -> "
           + ", ".join(f"{k} {v}" for k, v in results["slices"].items())
           + f" examples (salience: a seeded sample of {s['salience_examples_per_slice']} "
           "per slice). ROC AUC with 95 % bootstrap intervals "
           f"({s['num_resamples']} "
           "resamples; word level: examples resampled whole).", "",
           "| detector | " + " | ".join(f"{sl} {e} {lv}" for sl in slices for e in ERRORS
                                      for lv in REPORT_LEVELS) + " |",
           "|---|" + "---|" * (len(slices) * len(ERRORS) * len(REPORT_LEVELS))]
  for det, by_slice in results["auc"].items():
    cells = []
    for sl in slices:
      for e in ERRORS:
        for lv in REPORT_LEVELS:
          cells.append(common.fmt(by_slice[sl][e].get(lv)))
    lines.append(f"| {det} | " + " | ".join(cells) + " |")
  for det in PAPER_ORDER_DETECTORS:  # The paper's figures for the same slices.
    lines.append(f"| paper's {det} (Table 1) | " + " | ".join(
        (f"{PAPER_TABLE1[(sl, e)][det]:.3f}" if lv == "example" and (sl, e) in PAPER_TABLE1
         else "") for sl in slices for e in ERRORS for lv in REPORT_LEVELS) + " |")
  lines += ["", "word = the words of every example pooled; word_within = only pairs of words of "
            "the same example (the input's length drops out). Word labels: "
            "`evaluate.hallucination_word_labels` / `coverage_word_labels` (template words "
            "in neither class)."]
  nulls = results.get("nulls") or {}
  if nulls:
    lines += ["", "Nulls, in this run on the same examples (example level): each null's ROC "
              "AUC, then the detector's AUC minus the null's (paired interval).", "",
              "| detector | null | " + " | ".join(f"{sl} {e}" for sl in slices for e in ERRORS)
              + " |", "|---|---|" + "---|" * (len(slices) * len(ERRORS))]
    for det in sorted(nulls, key=_detector_rank):
      for null in NULLS.get(det, ()):
        cells = []
        for sl in slices:
          for e in ERRORS:
            found = (nulls[det].get(sl) or {}).get(null)
            cells.append("not measured" if not found else
                         f"{common.fmt(found['auc'][e])}; Δ {common.fmt(found['difference'][e])}")
        lines.append(f"| {det} | {null} | " + " | ".join(cells) + " |")
  length = results.get("length", {})
  if length:
    lines += ["", "Length control (example level, on the examples each AUC uses): Spearman "
              "correlation of the score with the input's length (content words), and the ROC "
              "AUC over the (error, clean) pairs whose inputs have the same length (what the "
              "score tells beyond length: one that only follows length gets 0.5).", "",
              "| detector | " + " | ".join(f"{sl} {e}" for sl in slices for e in ERRORS) + " |",
              "|---|" + "---|" * (len(slices) * len(ERRORS))]
    for det, by_slice in length.items():
      cells = []
      for sl in slices:
        for e in ERRORS:
          d = by_slice[sl][e]
          rho = "—" if d is None or d["spearman"] is None else f"{d['spearman']:+.2f}"
          cells.append("—" if d is None else f"ρ {rho}; matched "
                       f"{common.fmt(d['length_matched_auc'])}")
      lines.append(f"| {det} | " + " | ".join(cells) + " |")
  if results.get("substitution"):
    lines += ["", "Substitution probe (one argument of each unparaphrased error-free test example "
              "swapped for an unused one of its side: both errors, the counts unchanged; ROC AUC "
              "of each score, substituted vs clean; a score that only counts gets 0.5):", "",
              "| detector | hallucination score | coverage score |", "|---|---|---|"]
    for det, by_error in results["substitution"].items():
      lines.append(f"| {det} | " + " | ".join(common.fmt(by_error[e]) for e in ERRORS) + " |")
  accuracy = s.get("heldout_token_accuracy") or {}
  if accuracy:
    lines += ["", "Held-out token accuracy on the verbalisation task (nearly verbatim copying "
              "of the arguments): " + ", ".join(
                  f"{k} {v:.3f}" for k, v in accuracy.items() if v is not None) + "."]
  lines += ["", *verdict_lines(results)]
  lines += ["", "Seconds: " + ", ".join(f"{k[:-2]} {v:.0f}" for k, v in t.items()) + ".", "",
            f"Plot: `{results['plot']}`."]
  return "\n".join(lines)


def plot(results: Mapping[str, Any], path: str, *, title: str) -> str:
  """ROC AUC bars with intervals, one panel per level: detector x (slice, error)."""
  from jaxmoral import pictures  # pylint: disable=import-outside-toplevel
  from jaxmoral.npov import synthetic  # pylint: disable=import-outside-toplevel
  plt = pictures.pyplot()
  auc = results["auc"]
  # The report's order, also when `results` was read back from its (key-sorted) JSON.
  dets = sorted(auc, key=_detector_rank)
  groups = [(sl, e) for sl in synthetic.SLICES if sl in results["slices"] for e in ERRORS]
  fig, axes = plt.subplots(1, len(LEVELS), figsize=(12.5, 4), sharey=True)
  width = 0.8 / max(len(dets), 1)
  for ax, level in zip(axes, LEVELS):
    for k, det in enumerate(dets):
      xs = np.arange(len(groups)) + (k - (len(dets) - 1) / 2) * width
      cis = [auc[det][sl][e][level] for sl, e in groups]
      est = np.array([c["estimate"] if c else np.nan for c in cis])
      err = np.array([[c["estimate"] - c["low"] if c else 0 for c in cis],
                      [c["high"] - c["estimate"] if c else 0 for c in cis]])
      ax.bar(xs, est, width, yerr=err, capsize=3, label=det)
    ax.axhline(0.5, color="gray", linestyle="--", label="chance")
    ax.set_xticks(np.arange(len(groups)))
    ax.set_xticklabels([f"{sl[:6]}\n{e[:5]}" for sl, e in groups], fontsize=8)
    ax.set_title(f"{level} level")
    ax.set_ylim(0, 1)
    ax.grid(axis="y", alpha=0.3)
  axes[0].set_ylabel("ROC AUC (95 % CI)")
  # Beside the panels: inside, it hid the last group's word-level bars.
  axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.suptitle(title)
  return pictures.save_figure(fig, path, dpi=110)


if __name__ == "__main__":
  sys.exit(common.main(run_experiment))
