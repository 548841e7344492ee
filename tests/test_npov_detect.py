"""NPOV evaluation (ROC AUC, word labels), the detect_file entry point and the classifier score."""

import json
import pathlib
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxmoral import metrics
from jaxmoral import prompt_tuning as pt
from jaxmoral.models.config import t5_config
from jaxmoral.models.t5 import T5, init_params
from jaxmoral.npov import actions
from jaxmoral.npov import detect
from jaxmoral.npov import evaluate
from jaxmoral.npov import knowledge_base as kb_lib
from jaxmoral.npov import task
from jaxmoral.npov.detectors import base
from jaxmoral.npov.detectors import classifier
from jaxmoral.npov.detectors import rouge

# What runs is tested here, not how it is sharded (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_device")

CLEAN = task.NpovExample(
    id="a", topic="t", query="Should zoos be banned?",
    pro=("Animals suffer in small cages",), con=("Zoos protect endangered species",),
    response="Some say animals suffer in small cages. Others say zoos protect endangered species.",
    hallucination=False, coverage=False)
HALLUCINATION = CLEAN.replace(id="h", con=(), hallucination=True,
                              removed_argument="Zoos protect endangered species")
COVERAGE = CLEAN.replace(id="c", pro=CLEAN.pro + ("Zoos cost taxpayers money",), coverage=True,
                         added_argument="Zoos cost taxpayers money")


def _mann_whitney_auc(labels, scores):
  labels, scores = np.asarray(labels), np.asarray(scores)
  u = scipy.stats.mannwhitneyu(scores[labels == 1], scores[labels == 0]).statistic
  return u / ((labels == 1).sum() * (labels == 0).sum())


def test_word_labels():
  d = rouge.RougeDetector().detect(HALLUCINATION)
  labels = evaluate.hallucination_word_labels(HALLUCINATION, d.response_words)
  # "zoos" is in the removed argument but also in the query: supported, so negative.
  assert {w.text for w, y in zip(d.response_words, labels) if y} == {
      "protect", "endangered", "species"}
  assert {w.text for w, y in zip(d.response_words, labels) if y == 0} == {
      "say", "animals", "suffer", "small", "cages", "Others", "zoos"}  # "some": a stopword
  d = rouge.RougeDetector().detect(COVERAGE)
  labels = evaluate.coverage_word_labels(COVERAGE, d.argument_words)
  # "Zoos" of the added argument is said in the response: not missing from it.
  assert {w.text for w, y in zip(d.argument_words, labels) if y} == {"cost", "taxpayers",
                                                                     "money"}
  assert evaluate.coverage_word_labels(CLEAN, d.argument_words) == [0] * len(d.argument_words)


def test_template_words_are_in_neither_class():
  pro, con = ("Animals suffer in cages", "Zoos cost money"), ("Zoos save species",)
  clean = task.NpovExample(id="t", topic="t", query="Should zoos be banned?", pro=pro, con=con,
                           response=task.template_response("Should zoos be banned?", pro, con),
                           hallucination=False, coverage=False)
  wrong = clean.replace(pro=pro[:1], hallucination=True, removed_argument=pro[1])
  assert set(evaluate.TEMPLATE_WORDS) == {"people", "disagree", "claim", "supporters", "argue",
                                          "critics", "also", "point"}
  for example in (clean, wrong):
    d = rouge.RougeDetector().detect(example)
    labels = evaluate.hallucination_word_labels(example, d.response_words)
    template = {w.text for w, y in zip(d.response_words, labels) if y is None}
    assert template == {"People", "disagree", "claim", "Supporters", "argue", "They", "also",
                        "point", "Critics"} - {"They"}  # "they" is a stopword: never scored
  labels, _, _ = evaluate.word_arrays([clean, wrong], [rouge.RougeDetector().detect(e)
                                                       for e in (clean, wrong)], "hallucination")
  # Only "cost" and "money" are positive ("zoos" is in the query); template words are dropped.
  assert labels.sum() == 2 and labels.size == 2 * 11
  # An organic error (no removed argument: no word-level truth) adds no words.
  organic = wrong.replace(removed_argument=None)
  again, _, units = evaluate.word_arrays(
      [clean, organic, wrong], [rouge.RougeDetector().detect(e) for e in (clean, organic, wrong)],
      "hallucination")
  np.testing.assert_array_equal(again, np.concatenate([labels[:11], labels[11:]]))
  assert sorted(set(units.tolist())) == [0, 2]


def test_untrained_detector_is_the_same_pipeline_on_fresh_weights():
  config = t5_config(size="tiny", vocab_size=128, d_model=32, d_kv=8, d_ff=64,
                     num_encoder_layers=1, num_decoder_layers=1)
  untrained = detect.build_untrained_detector("classifier", config=config,
                                              vocabulary=WordVocab(), seed=3)
  params = nn.meta.unbox(init_params(T5(config), jax.random.split(jax.random.PRNGKey(3))[0]))
  reference = classifier.ClassifierDetector(
      model=T5(config), vocabulary=WordVocab(),
      classifiers={e: (params, None) for e in classifier.ERROR_TYPES})
  got, want = (d.detect_batch([CLEAN, COVERAGE]) for d in (untrained, reference))
  np.testing.assert_allclose([(d.hallucination, d.coverage) for d in got],
                             [(d.hallucination, d.coverage) for d in want], rtol=1e-6)
  # With the trained detector's prompt length: an untrained prompt from the fresh embeddings.
  prompted = detect.build_untrained_detector("classifier", config=config,
                                             vocabulary=WordVocab(), seed=3, prompt_length=3)
  assert detect.prompt_length(prompted) == 3 and detect.prompt_length(untrained) is None
  (_, a), (_, b) = prompted.classifiers.values()
  np.testing.assert_array_equal(a, b)
  embeddings = np.asarray(params["token_embedder"]["embedding"])
  assert all(np.isclose(embeddings, row).all(axis=1).any() for row in np.asarray(a))
  with pytest.raises(ValueError, match="has no model"):
    detect.build_untrained_detector("rouge", config=config, vocabulary=WordVocab())


def test_evaluate_slice_auc_matches_mann_whitney():
  rng = np.random.default_rng(0)
  examples, detections = [], []
  for i in range(40):
    kind = i % 3
    e = [CLEAN, HALLUCINATION, COVERAGE][kind].replace(id=str(i))
    examples.append(e)
    detections.append(base.Detection(rng.normal() + (kind == 1), rng.normal() + (kind == 2)))
  result = evaluate.evaluate_slice(examples, detections)
  for error, kind in (("hallucination", 1), ("coverage", 2)):
    keep = [i for i in range(40) if i % 3 in (0, kind)]
    labels = [int(i % 3 == kind) for i in keep]
    scores = [getattr(detections[i], error) for i in keep]
    assert result[error]["example_auc"] == pytest.approx(_mann_whitney_auc(labels, scores))
    assert result[error]["num_examples"] == len(keep)
  table = evaluate.format_table({"unparaphrased": {"x": result}})
  assert "x" in table and f"{100 * result['coverage']['example_auc']:.1f} [" in table
  assert "unparaphrased/hallucination/example" in table.splitlines()[0]  # Not clipped.
  ci = metrics.bootstrap_ci(metrics.roc_auc, np.asarray(labels), np.asarray(scores, float))
  assert result["coverage"]["example_auc_ci"] == pytest.approx([ci.low, ci.high])
  assert f"{len(keep)} ({sum(labels)} pos)" in table.splitlines()[-2]


def test_detect_file_rouge_round_trip(tmp_path):
  path = tmp_path / "responses.jsonl"
  task.write_examples([CLEAN, HALLUCINATION, COVERAGE], path)
  records = actions.detect_file(input_path=str(path), output_path=str(tmp_path / "out.jsonl"),
                                detector="rouge", roc_dir=str(tmp_path / "roc"))
  lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
  assert lines == records and [r["id"] for r in lines] == ["a", "h", "c"]
  expected = rouge.RougeDetector().detect(HALLUCINATION)
  assert lines[1]["hallucination"] == pytest.approx(expected.hallucination)
  assert lines[1]["response_words"][0]["text"] == expected.response_words[0].text
  saved = json.loads((tmp_path / "roc" / "results.json").read_text())
  assert saved["input"]["rouge"]["hallucination"]["example_auc"] == 1.0
  assert (tmp_path / "roc" / "roc_input.png").stat().st_size > 1000
  with pytest.raises(ValueError, match="unknown detector"):
    detect.build_detector("bert")


def test_evaluate_run_on_a_jsonl_kb(tmp_path):
  kb = tmp_path / "kb.jsonl"
  kb.write_text(json.dumps({
      "query": "Should zoos be banned?", "split": "test",
      "pro": [["Animals suffer in small cages", "Cages make animals suffer"],
              "Zoos cost taxpayers money"],
      "con": [["Zoos protect endangered species", "Endangered species survive thanks to zoos"],
              "Children learn about nature"]}) + "\n")
  results = actions.run(output_dir=str(tmp_path / "eval"), kb_path=str(kb), seed=1)
  assert set(results) == {"unparaphrased", "paraphrased"}
  assert (tmp_path / "eval" / "table.txt").read_text().startswith("detector")


class WordVocab:
  """Vocabulary stand-in: one id per character (letters ids 3..)."""

  def encode(self, text):
    return [3 + (ord(c) % 100) for c in text]


def test_classifier_score_is_softmax_of_label_logits():
  config = t5_config(size="tiny", vocab_size=128, d_model=32, d_kv=8, d_ff=64,
                     num_encoder_layers=1, num_decoder_layers=1)
  model = T5(config)
  params = nn.meta.unbox(init_params(model, jax.random.PRNGKey(0)))
  prompts = {e: np.random.default_rng(i).normal(size=(3, 32)).astype(np.float32)
             for i, e in enumerate(classifier.ERROR_TYPES)}
  # Coverage: a prompt over the base; hallucination: fine-tuned weights of its own, no prompt
  # (`tuning="full"`).
  tuned = jax.tree.map(lambda x: 1.5 * x + 0.01, params)
  detector = classifier.ClassifierDetector(
      model=model, vocabulary=WordVocab(), batch_size=2,
      classifiers={"hallucination": (tuned, None), "coverage": (params, prompts["coverage"])})
  examples = [CLEAN, HALLUCINATION, COVERAGE]
  got = detector.detect_batch(examples)
  yes, no = classifier.label_token_ids(WordVocab())
  prompted = pt.PromptedT5(config, 3)
  # One compiled forward per input length (op-by-op it compiles every op of the model).
  prompted_logits = jax.jit(lambda p, tokens: prompted.apply(
      {"params": p}, tokens, jnp.zeros((1, 1), jnp.int32))[0, 0])
  plain_logits = jax.jit(lambda p, tokens: model.apply(
      {"params": p}, tokens, jnp.zeros((1, 1), jnp.int32))[0, 0])
  for e, d in zip(examples, got):
    tokens = jnp.array([WordVocab().encode(task.format_classifier_input(e)) + [1]])
    for error, logits in (
        ("hallucination", plain_logits(tuned, tokens)),
        ("coverage", prompted_logits(pt.prompted_params(params, prompts["coverage"]), tokens))):
      p_no = np.exp(logits[no]) / (np.exp(logits[no]) + np.exp(logits[yes]))
      assert getattr(d, error) == pytest.approx(float(p_no), abs=1e-5)
  # The fine-tuned weights are what scores: the base's give another number.
  base_logits = plain_logits(params, jnp.array(
      [WordVocab().encode(task.format_classifier_input(CLEAN)) + [1]]))
  assert got[0].hallucination != pytest.approx(float(jax.nn.softmax(
      base_logits[jnp.array([yes, no])])[1]), abs=1e-3)


def test_training_pairs_keep_examples_with_both_errors_and_skip_the_other_error():
  """Each classifier learns from error-free examples ("yes") and every example with its error
  ("no"), a substitution (both errors) included; an example with only the other error is
  neither and is left out."""
  substitution = CLEAN.replace(id="s", pro=("Zoos cost taxpayers money",), hallucination=True,
                               coverage=True, removed_argument=CLEAN.pro[0],
                               added_argument="Zoos cost taxpayers money")
  examples = [CLEAN, HALLUCINATION, COVERAGE, substitution]
  for error, kept in (("hallucination", [CLEAN, HALLUCINATION, substitution]),
                      ("coverage", [CLEAN, COVERAGE, substitution])):
    inputs, targets = classifier.training_pairs(examples, error=error)
    assert inputs == [task.format_classifier_input(e) for e in kept]
    assert targets == ["yes", "no", "no"]
  assert task.format_classifier_input(COVERAGE).endswith("{response: " + COVERAGE.response + "}")


def test_load_classifier_reads_a_fine_tuned_model_or_a_prompt(tmp_path):
  """`tuning="full"` classifiers are model directories (their own weights, no prompt); a
  prompt directory runs on the base's weights; another architecture is refused unread."""
  from jaxmoral import model_dirs  # pylint: disable=g-import-not-at-top
  config = t5_config(size="tiny", vocab_size=128, d_model=32, d_kv=8, d_ff=64,
                     num_encoder_layers=1, num_decoder_layers=1)
  rng = np.random.default_rng(0)  # Any numbers do: shapes traced, nothing compiled.
  base_params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), nn.meta.unbox(
      jax.eval_shape(lambda: init_params(T5(config), jax.random.PRNGKey(0)))))
  tuned_params = jax.tree.map(lambda x: x + 1.0, base_params)
  model_dirs.export(tmp_path / "base", params=base_params, config=config)
  model_dirs.export(tmp_path / "tuned", params=tuned_params, config=config)
  prompt = np.random.default_rng(0).normal(size=(3, 32)).astype(np.float32)
  pt.save_prompt(prompt, tmp_path / "prompt")
  base = model_dirs.load(tmp_path / "base")
  params, no_prompt = classifier.load_classifier(tmp_path / "tuned", base)
  assert no_prompt is None
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(tuned_params)):
    np.testing.assert_array_equal(np.asarray(got), want)
  params, got_prompt = classifier.load_classifier(tmp_path / "prompt", base)
  np.testing.assert_array_equal(got_prompt, prompt)
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(base_params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  deeper = config.replace(num_encoder_layers=2)
  model_dirs.export(tmp_path / "deeper", params=base_params, config=deeper)
  with pytest.raises(ValueError, match="architecture differs from the base"):
    classifier.load_classifier(tmp_path / "deeper", base)
  with pytest.raises(ValueError, match="tuning must be one of"):
    classifier.train_classifier(model_dir=tmp_path / "x", base_dir=str(tmp_path / "base"),
                                examples=[CLEAN, HALLUCINATION], error="hallucination",
                                train_steps=1, optimizer=None, tuning="lora")


def test_train_classifier_trains_the_kind_asked_on_shuffled_pairs(tmp_path, monkeypatch):
  """`tuning` picks the trained model; the pairs are shuffled, so even a run holding out every
  10th pair (`heldout="position"`) holds out both labels (in `training_pairs`' order they
  alternate, so every 10th would be a clean example)."""
  from jaxmoral import model_dirs, runs  # pylint: disable=g-import-not-at-top
  from jaxmoral.models import trainable  # pylint: disable=g-import-not-at-top
  config = t5_config(size="tiny", vocab_size=128, d_model=32, d_kv=8, d_ff=64,
                     num_encoder_layers=1, num_decoder_layers=1)
  model_dirs.export(tmp_path / "base", params=nn.meta.unbox(
      init_params(T5(config), jax.random.PRNGKey(0))), config=config)
  runs_seen = []
  monkeypatch.setattr(runs, "train_run", lambda **kwargs: runs_seen.append(kwargs))
  examples = [e.replace(id=f"{e.id}{i}") for i in range(100) for e in (CLEAN, HALLUCINATION)]
  for tuning in classifier.TUNINGS:
    classifier.train_classifier(model_dir=tmp_path / tuning, base_dir=str(tmp_path / "base"),
                                examples=examples, error="hallucination", train_steps=1,
                                optimizer=None, tuning=tuning)
  assert [type(r["model"]) for r in runs_seen] == [pt.PromptTuningModel, trainable.Seq2SeqModel]
  rows = [json.loads(line) for line in (tmp_path / "full" / "data" / "train.jsonl").open()]
  assert sorted(r["targets"] for r in rows) == ["no"] * 100 + ["yes"] * 100
  assert {r["targets"] for r in rows[::10]} == {"yes", "no"}


@pytest.mark.parametrize("change, line, field, message", [
    ({"response": None}, 2, "response", "missing required field"),
    # A misspelt key is named, with the key it likely stands for.
    ({"respnse": "typo"}, 2, "respnse", "unknown field 'respnse' (did you mean 'response'?)"),
    ({"id": "a"}, 2, "id", "id 'a' is also the id of line 1"),
    ({"paraphrased": "no"}, 2, "paraphrased", "expected true/false"),
])
def test_detect_file_names_a_bad_example(tmp_path, change, line, field, message):
  rows = [CLEAN.to_json(), {**HALLUCINATION.to_json(), **change}]
  rows[1] = {k: v for k, v in rows[1].items() if not (k == "response" and v is None)}
  if "respnse" in change:
    del rows[1]["response"]
  path = tmp_path / "in.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  with pytest.raises(ValueError) as error:
    actions.detect_file(input_path=str(path), output_path=str(tmp_path / "out.jsonl"))
  assert (error.value.line, error.value.field) == (line, field) and message in str(error.value)


def test_heatmaps_are_for_salience_and_have_a_file_per_id(tmp_path):
  path = tmp_path / "in.jsonl"
  task.write_examples([CLEAN], path)
  with pytest.raises(ValueError, match="heatmap_dir is for detector='salience'"):
    actions.detect_file(input_path=str(path), output_path=str(tmp_path / "o.jsonl"),
                        heatmap_dir=str(tmp_path / "h"))
  names = {actions.heatmap_file_name(i) for i in ("topic 1/a", "topic 1?a", "topic_1_a", "a")}
  assert len(names) == 4 and "a.html" in names and "topic_1_a.html" in names


def test_npov_commands_take_gin_bindings_without_a_gin_file(tmp_path):
  import gin  # pylint: disable=g-import-not-at-top
  from jaxmoral import cli  # pylint: disable=g-import-not-at-top
  path = tmp_path / "in.jsonl"
  task.write_examples([CLEAN, HALLUCINATION, COVERAGE], path)
  scores = {}
  for include_query in (False, True):
    gin.clear_config()
    out = tmp_path / f"out_{include_query}.jsonl"
    assert cli.main(["npov", "detect", f"--input_path={path}", f"--output_path={out}",
                     f"--gin.RougeDetector.include_query={include_query}"]) == 0
    scores[include_query] = [json.loads(x)["hallucination"] for x in out.read_text().splitlines()]
  gin.clear_config()
  expected = rouge.RougeDetector(include_query=True).detect(HALLUCINATION).hallucination
  assert scores[True][1] == pytest.approx(expected) and scores[True] != scores[False]


def test_detect_file_gives_the_classifier_its_two_prompt_dirs(tmp_path, monkeypatch):
  path = tmp_path / "in.jsonl"
  task.write_examples([CLEAN], path)
  seen = {}

  def build(name, **kwargs):
    seen.update(name=name, **kwargs)
    return rouge.RougeDetector()
  monkeypatch.setattr(detect, "build_detector", build)
  actions.detect_file(input_path=str(path), output_path=str(tmp_path / "o.jsonl"),
                      detector="classifier", base_dir="base", hallucination_dir="h",
                      coverage_dir="c")
  assert seen["name"] == "classifier" and seen["base_dir"] == "base"
  assert seen["classifier_dirs"] == {"hallucination": "h", "coverage": "c"}
  # Only the one given: build_detector then names the missing error type.
  actions.detect_file(input_path=str(path), output_path=str(tmp_path / "o.jsonl"),
                      detector="classifier", base_dir="base", coverage_dir="c")
  assert seen["classifier_dirs"] == {"coverage": "c"}


def test_npov_detect_flags_are_the_functions_arguments(tmp_path, capsys):
  import gin  # pylint: disable=g-import-not-at-top
  from jaxmoral import cli  # pylint: disable=g-import-not-at-top
  path = tmp_path / "in.jsonl"
  task.write_examples([CLEAN, HALLUCINATION], path)
  out = tmp_path / "out.jsonl"
  gin.clear_config()
  try:
    # The old argparse names are no flags of detect_file: one line, naming the flag.
    assert cli.main(["npov", "detect", f"--input={path}", f"--output_path={out}"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("jaxmoral")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "detect: unknown flag --input;" in errors[0] and "--input_path" in errors[0]
    assert not out.exists()
    gin.clear_config()
    assert cli.main(["npov", "detect", f"--input_path={path}", f"--output_path={out}",
                     "--detector=rouge"]) == 0
  finally:
    gin.clear_config()
  assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["a", "h"]


def test_salience_heatmap_colours_words_in_place_and_flags_only_outliers(tmp_path):
  import re  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  from jaxmoral.npov import plots  # pylint: disable=g-import-not-at-top
  words = [(m.group(), m.start(), m.end()) for m in re.finditer(r"\w+", CLEAN.response)]
  scores = [0.6] * len(words)
  scores[3] = 0.95  # One word stands out of a uniformly high background.
  response = tuple(base.WordScore("response", 0, t, s, e, v)
                   for (t, s, e), v in zip(words, scores))
  argument = tuple(base.WordScore("pro", 0, m.group(), m.start(), m.end(), 0.1)
                   for m in re.finditer(r"\w+", CLEAN.pro[0]))
  detection = base.Detection(0.7, 0.2, response, argument)
  word_map = types.SimpleNamespace(
      matrix=np.zeros((len(argument), len(words))), response_words=response,
      input_words=tuple(("pro", 0, w) for w in argument))
  page = pathlib.Path(plots.salience_heatmap_html(word_map, detection, tmp_path / "x.html",
                                                  title="q", example=CLEAN)).read_text()
  # Reference: mean + 1 sd of the response scores; only the outlier is above it.
  cutoff = np.mean(scores) + np.std(scores)
  assert sum(s > cutoff for s in scores) == 1
  assert page.count("text-decoration:underline") == 1
  assert f"(1 of {len(words)} words flagged)" in page
  # In place: the response's own text, each word in a span with its colour and value.
  assert f'title="0.950">{words[3][0]}</span>' in page
  assert "</span>. <span" in page  # The text between scored words is kept.
  assert "Scale (word error score)" in page


def test_train_classifier_action_trains_on_synthetic_errors_of_the_training_topics(
    tmp_path, monkeypatch):
  kb_path = pathlib.Path(actions.__file__).parents[1] / "data" / "demo" / "npov_kb.jsonl"
  split_of = {t.id: t.split for t in kb_lib.split_topics(kb_lib.read_kb_jsonl(str(kb_path)))}
  seen = {}
  monkeypatch.setattr(classifier, "train_classifier",
                      lambda **kwargs: seen.update(kwargs) or str(kwargs["model_dir"]))
  result = actions.train_error_classifier(model_dir=str(tmp_path / "h"), base_dir="base",
                                          error="hallucination", kb_path=str(kb_path),
                                          train_steps=7)
  examples = seen["examples"]
  assert result == {"model_dir": str(tmp_path / "h"), "error": "hallucination",
                    "examples": len(examples)}
  assert seen["error"] == "hallucination" and seen["train_steps"] == 7
  # Test topics stay unseen; every error-free source comes with its synthetic errors.
  assert {split_of[e.topic] for e in examples} == {"train"}
  assert {bool(e.hallucination) for e in examples} == {False, True}
  assert {e.paraphrased for e in examples} == {False, True}
  with pytest.raises(ValueError, match="error must be one of hallucination, coverage"):
    actions.train_error_classifier(model_dir=str(tmp_path / "x"), base_dir="base",
                                   error="halucination", kb_path=str(kb_path))


def test_roc_picture_with_one_empty_panel_says_why_and_warns_nothing(tmp_path):
  from jaxmoral.npov import plots  # pylint: disable=g-import-not-at-top
  result = {"hallucination": {"labels": [0, 1, 0, 1], "scores": [0.1, 0.9, 0.4, 0.3],
                              "example_auc": 0.75},
            "coverage": {"labels": [0, 0, 0, 0], "scores": [0.1, 0.2, 0.3, 0.4],
                         "example_auc": None}}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert plots.roc_curves_png({"rouge": result}, tmp_path / "roc.png", title="t")
  assert (tmp_path / "roc.png").stat().st_size > 0
  assert not plots.roc_curves_png({"rouge": {**result, "hallucination": result["coverage"]}},
                                  tmp_path / "none.png")
  assert not (tmp_path / "none.png").exists()
