"""Every model-using command on a (2, 2) mesh (data x model, 4 of the 8 fake CPU devices) gives
what it gives on one device, with its parameters read straight into the partitioner's
shardings."""

import json

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import toy_dialogues
from jaxmoral import api
from jaxmoral import cli
from jaxmoral import model_dirs
from jaxmoral import partitioning
from jaxmoral import prompt_tuning
from jaxmoral import runs
from jaxmoral.clarify import chat as clarify_chat
from jaxmoral.clarify import evaluate as clarify_evaluate
from jaxmoral.data import readers
from jaxmoral.data import demo as demo_data
from jaxmoral.data import vocab as vocab_lib
from jaxmoral.diamante import candidates as diamante_candidates
from jaxmoral.diamante import chat as diamante_chat
from jaxmoral.diamante import evaluate as diamante_evaluate
from jaxmoral.diamante import inference as diamante_inference
from jaxmoral.diamante import data as diamante_data
from jaxmoral.models import t5
from jaxmoral.models.config import t5_config
from jaxmoral.npov import detect
from jaxmoral.npov import task

# One encoder and one decoder layer: every sharded axis (vocab 512, 4 heads, mlp 128) divides
# the model axis of 2.
CONFIG = t5_config(size="tiny", num_encoder_layers=1, num_decoder_layers=1)
RERANK = diamante_inference.RerankConfig(num_candidates=4, top_k=10, max_decode_length=6)
JUDGE_CLASSES = ("wrong", "okay", "good")  # One token each in the demo vocabulary.
EXAMPLES = [
    task.NpovExample(
        id="a", topic="t", query="Should zoos be banned?",
        pro=("Animals suffer in small cages",), con=("Zoos protect endangered species",),
        response="Some say animals suffer in small cages. Others say zoos protect species."),
    task.NpovExample(
        id="b", topic="t", query="Is homework useful?", pro=("It builds habits",),
        con=("It takes family time",), response="Homework builds habits but takes time."),
]


@pytest.fixture(scope="module")
def mesh():
  """Two-way data parallel, two-way model parallel, T5X's 1-D parameter rules. Four devices
  split both axes as eight do, and their programs compile and run faster on 2 cores."""
  partitioner = partitioning.PjitPartitioner(num_partitions=2, devices=jax.devices()[:4])
  assert dict(partitioner.mesh.shape) == {"data": 2, "model": 2}
  return partitioner


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, demo_vocab_path):
  """A tiny T5 export, a second one (a fine-tuned classifier), a soft prompt, a Diamante model
  (scalar head, its run settings) and data files for them."""
  root = tmp_path_factory.mktemp("on_mesh")
  vocabulary = vocab_lib.get_vocabulary(demo_vocab_path)

  # One initialisation (tracing and compiling T5's init costs seconds); the three models are
  # its weights times independent random factors, as in conftest's `write_hf_t5`: different
  # weights at the initialiser's scales.
  init = jax.device_get(nn.meta.unbox(jax.jit(
      lambda r: t5.init_params(t5.T5(CONFIG, with_scalar_head=True), r))(
          jax.random.PRNGKey(1))))

  def random_params(seed: int, with_scalar_head: bool = False):
    rng = np.random.default_rng(seed)
    params = jax.tree.map(
        lambda x: (x * (1.0 + 0.3 * rng.standard_normal(x.shape))).astype(x.dtype), init)
    if not with_scalar_head:
      del params["scalar_head"]
    return params

  lm = model_dirs.export(root / "lm", params=random_params(1), config=CONFIG,
                         vocabulary=vocabulary)
  tuned = model_dirs.export(root / "tuned", params=random_params(2), config=CONFIG,
                            vocabulary=vocabulary)
  prompt = np.random.default_rng(0).normal(size=(3, CONFIG.d_model)).astype(np.float32)
  prompt_tuning.save_prompt(prompt, root / "prompt")
  params = random_params(3, with_scalar_head=True)
  params["scalar_head"]["kernel"] = params["scalar_head"]["kernel"] * 5.0
  settings = {"data": {"separator": diamante_data.DEFAULT_SEPARATOR},
              "feature_lengths": {"inputs": 24, "targets": 8}}
  diamante = model_dirs.export(root / "diamante", params=params, config=CONFIG,
                               vocabulary=vocabulary, settings=settings)
  rows = [{"inputs": f"question: {r['situation']}", "targets": r["question"]}
          for r in demo_data.clarify_questions()[:16]]
  pairs = readers.write_jsonl(root / "pairs.jsonl", rows[:8])
  eval_pairs = readers.write_jsonl(root / "eval_pairs.jsonl", rows[8:])  # One batch of 8.
  inputs = root / "inputs.txt"
  inputs.write_text("why would someone skip a party\n\nlying to a friend\nhelping a stranger\n")
  turns = toy_dialogues.toy_turns(4, seed=1)
  test_path = root / "test.jsonl"
  readers.write_jsonl(test_path, [toy_dialogues.toy_dialogue(np.random.default_rng(i))
                                  for i in range(4)])
  return {"root": root, "lm": lm, "tuned": tuned, "prompt": str(root / "prompt"),
          "diamante": diamante, "pairs": str(pairs), "eval_pairs": str(eval_pairs),
          "inputs": str(inputs), "test": str(test_path), "turns": turns}


def _assert_close(a, b, *, rtol=1e-4, atol=1e-5):
  """Equal structures; floats to float32 tolerance, everything else exactly."""
  if isinstance(a, dict):
    assert isinstance(b, dict) and sorted(a) == sorted(b)
    for key in a:
      _assert_close(a[key], b[key], rtol=rtol, atol=atol)
  elif isinstance(a, (list, tuple)):
    assert isinstance(b, (list, tuple)) and len(a) == len(b)
    for x, y in zip(a, b):
      _assert_close(x, y, rtol=rtol, atol=atol)
  elif isinstance(a, float) or isinstance(b, float) or isinstance(a, np.ndarray):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol,
                               atol=atol)
  else:
    assert a == b


def test_parameters_are_read_into_the_partitioners_shardings(dirs, mesh):
  loaded = model_dirs.load_on_mesh(dirs["lm"], partitioner=mesh)
  assert loaded.partitioner is mesh
  embedding = loaded.params["token_embedder"]["embedding"]  # (vocab, embed): vocab -> model
  assert embedding.sharding.mesh == mesh.mesh
  assert embedding.sharding.spec == PartitionSpec("model", None)
  assert {s.data.shape for s in embedding.addressable_shards} == {(CONFIG.vocab_size // 2,
                                                                    CONFIG.d_model)}
  # The default: one device.
  one = model_dirs.load_on_mesh(dirs["lm"])
  assert len(one.params["token_embedder"]["embedding"].sharding.device_set) == 1
  np.testing.assert_array_equal(np.asarray(embedding),
                                np.asarray(one.params["token_embedder"]["embedding"]))
  # An export read and written from the mesh (`jaxmoral export --num_partitions=2`) holds
  # the same numbers.
  exported = dirs["root"] / "exported"
  assert cli.main(["export", f"--model_dir={dirs['lm']}", f"--output={exported}",
                   "--num_partitions=2"]) == 0
  again = model_dirs.load(exported)
  for got, want in zip(jax.tree.leaves(again.params), jax.tree.leaves(one.params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_api_model_scores_on_the_mesh_as_on_one_device(dirs, mesh):
  sharded = api.Model.from_pretrained(dirs["lm"], partitioner=mesh)
  assert sharded.params["token_embedder"]["embedding"].sharding.spec == PartitionSpec("model",
                                                                                      None)
  inputs, targets = ["skipping a party", "lying to a friend"], ["why?", "to protect her"]
  np.testing.assert_allclose(sharded.score(inputs, targets),
                             api.Model.from_pretrained(dirs["lm"]).score(inputs, targets),
                             rtol=1e-5)


def test_eval_and_infer_match_one_device(dirs, mesh):
  data = runs.Seq2SeqData(train_file=dirs["pairs"], eval_file=dirs["eval_pairs"])
  lengths = {"inputs": 32, "targets": 8}
  reports = [runs.eval_run(model_dir=dirs["lm"], data=data, feature_lengths=lengths,
                           batch_size=8, decode_examples=4, partitioner=p)
             for p in (None, mesh)]
  assert reports[0]["samples"] and reports[0]["metrics"]["loss"] > 0
  _assert_close(reports[1], reports[0])
  outputs = []
  for name, p in (("one", None), ("mesh", mesh)):
    path = dirs["root"] / f"infer_{name}.jsonl"
    # The shapes and settings of eval's decodes: the same compiled sampler.
    runs.infer_run(model_dir=dirs["lm"], input_file=dirs["inputs"], output_file=str(path),
                   input_length=32, batch_size=4, partitioner=p,
                   sample_config=runs.decoding.SampleConfig(max_decode_length=8, greedy=True))
    outputs.append([json.loads(line) for line in path.read_text().splitlines()])
  assert len(outputs[0]) == 4 and outputs[0][1]["predictions"] == []
  assert any(r["predictions"] and r["predictions"][0] for r in outputs[0])
  _assert_close(outputs[1], outputs[0])


def test_npov_detectors_match_one_device(dirs, mesh):
  results = []
  for p in (None, mesh):
    salience = detect.build_detector("salience", base_dir=dirs["lm"],
                                     generator_dir=dirs["prompt"], partitioner=p)
    maps = [salience.word_map(EXAMPLES[0])]  # One example: one compiled shape.
    classifier = detect.build_detector(
        "classifier", base_dir=dirs["lm"], partitioner=p,
        classifier_dirs={"hallucination": dirs["tuned"], "coverage": dirs["prompt"]})
    if p is not None:  # The fine-tuned classifier's weights are sharded too.
      tuned, _ = classifier.classifiers["hallucination"]
      assert tuned.params["token_embedder"]["embedding"].sharding.spec == PartitionSpec("model", None)
    results.append({
        "token_salience": [m.token_matrix for m in maps],
        "detections": [salience.detect_from_map(m).to_json() for m in maps],
        "hallucination": classifier.error_probabilities(EXAMPLES, "hallucination"),
        "coverage": classifier.error_probabilities(EXAMPLES, "coverage")})
  assert np.abs(results[0]["token_salience"][0]).max() > 0
  _assert_close(results[1], results[0])


def test_diamante_evaluate_candidates_and_chat_match_one_device(dirs, mesh):
  results = []
  for name, p in (("one", None), ("mesh", mesh)):
    # Its reranked generations are the chat's (`inference.respond`), tested below.
    metrics = diamante_evaluate.evaluate(model_dir=dirs["diamante"], test_path=dirs["test"],
                                         num_random=2, max_candidates=3, num_generate=0,
                                         batch_size=4, partitioner=p)
    out = dirs["root"] / f"candidates_{name}.jsonl"
    diamante_candidates.generate_candidates(
        model_dir=dirs["diamante"], turns=dirs["turns"], output_path=str(out),
        num_candidates=2, max_decode_length=6, batch_size=4, seed=1, partitioner=p)
    chat = diamante_chat.self_chat(
        model_dir=dirs["diamante"], opening="hello there", num_rounds=2, rerank=RERANK,
        transcript_path=str(dirs["root"] / f"self_{name}.jsonl"), output=None, partitioner=p)
    results.append({"metrics": metrics, "candidates": out.read_text(), "chat": chat})
  assert results[0]["metrics"]["num_contexts"] > 0
  _assert_close(results[1], results[0])


def test_clarify_evaluate_and_chat_match_one_device(dirs, mesh):
  lm = dirs["lm"]
  results = []
  for p in (None, mesh):
    evaluation = clarify_evaluate.evaluate_model_dirs(
        question_model_dir=lm, answer_model_dir=lm, fusion_model_dir=lm, judge_model_dir=lm,
        max_situations=2, output_path=None, judge_classes=JUDGE_CLASSES, partitioner=p)
    # The chat's models: loaded as `chat` and `chat_from_file` load them, judging with the
    # program the evaluation compiled (its turns call the same `models` functions).
    session = clarify_chat._session(  # pylint: disable=protected-access
        question_model_dir=lm, fusion_model_dir=lm, judge_model_dir=lm, answer_model_dir=lm,
        judge_classes=JUDGE_CLASSES, top_p=0.6, seed=0, partitioner=p)
    if p is not None:
      params = session.question_model.params
      assert session.judge_model.partitioner is mesh
      assert params["token_embedder"]["embedding"].sharding.spec == PartitionSpec("model", None)
    results.append({"evaluate": evaluation, "judge": session.judge("skipping a party")})
  assert results[0]["evaluate"]["pipeline"]["question_pct"] >= 0
  _assert_close(results[1], results[0])
