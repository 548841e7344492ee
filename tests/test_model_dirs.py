"""jaxmoral.model_dirs: every format found, loaded into a partitioner's shardings, and saved.

Hugging Face checkpoints are written by `transformers` (safetensors, sharded, bfloat16,
`pytorch_model.bin`) and compared with the torch model on the same weights; T5X, export, run,
run step, PPO run and prompt-tuning run directories are written with Orbax here; a Hub id is
resolved from a local Hub cache with networking off.
"""

from __future__ import annotations

import functools
import json
import logging
import sys

import flax
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import hf_logits, write_hf_t5  # noqa: E402
from jaxmoral import checkpoints  # noqa: E402
from jaxmoral import model_dirs  # noqa: E402
from jaxmoral import partitioning  # noqa: E402
from jaxmoral import run_dirs  # noqa: E402
from jaxmoral.models import hf_import  # noqa: E402
from jaxmoral.models import t5  # noqa: E402
from jaxmoral.models.config import T5Config  # noqa: E402

VOCAB = 96
VARIANTS = {"t5_1_0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
            "t5_1_1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)}


def _batch():
  rng = np.random.RandomState(0)
  enc = rng.randint(2, VOCAB, (2, 9)).astype(np.int32)
  enc[1, 5:] = 0
  dec = rng.randint(2, VOCAB, (2, 6)).astype(np.int32)
  dec[:, 0] = 0
  return enc, dec


@functools.lru_cache(maxsize=None)
def _jitted_apply(config):
  # One jitted forward per config: the tests loading the same tiny T5 from several formats
  # trace it once (a fresh jax.jit per call traced the model again each time).
  return jax.jit(t5.T5(config).apply)


def jax_logits(loaded, enc, dec) -> np.ndarray:
  params = {k: v for k, v in loaded.params.items() if k != "scalar_head"}
  return np.asarray(_jitted_apply(loaded.config)({"params": params}, enc, dec))


def assert_close(ours, ref):
  np.testing.assert_allclose(ours, ref, atol=1e-4 * max(1.0, np.abs(ref).max()), rtol=1e-4)


def _tiny_hf(directory, variant="t5_1_1", seed=0, **kwargs):
  return write_hf_t5(directory, seed=seed, vocab_size=VOCAB, num_layers=2,
                     num_decoder_layers=3, **{**VARIANTS[variant], **kwargs})


@pytest.fixture(scope="module")
def mesh():
  return partitioning.PjitPartitioner(num_partitions=4)  # (data 2, model 4) on 8 devices.


# -- Hugging Face ---------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_safetensors_loads_sharded_and_matches_torch(variant, tmp_path, mesh):
  model = _tiny_hf(tmp_path, variant)
  loaded = model_dirs.load(tmp_path, partitioner=mesh)
  assert loaded.info.format == "hf"
  assert loaded.config.num_encoder_layers == 2 and loaded.config.num_decoder_layers == 3
  assert loaded.config.tie_word_embeddings == VARIANTS[variant]["tie_word_embeddings"]
  # Every parameter is created in the sharding the partitioner's rules ask for.
  want = model_dirs.param_shardings(loaded.config, mesh)
  for got, expected in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(want)):
    assert got.sharding == expected and got.dtype == jnp.float32
  kernel = loaded.params["encoder"]["layers_0"]["attention"]["query"]["kernel"]
  assert kernel.addressable_shards[0].data.shape == (32, 32 // 4)  # joined_kv over "model".
  enc, dec = _batch()
  assert_close(jax_logits(loaded, enc, dec), hf_logits(model, enc, dec))


def _as_pytorch_bin(directory, model, *, shards: int = 1) -> None:
  """Re-saves a folder as older Hugging Face releases did: `pytorch_model.bin` (or shards
  with `pytorch_model.bin.index.json`) instead of safetensors (transformers 5 writes only
  safetensors, but many published T5 fine-tunes have only these)."""
  for f in directory.glob("model*.safetensors*"):
    f.unlink()
  state = {k: v.detach().clone() for k, v in model.state_dict().items()}
  if shards == 1:
    torch.save(state, directory / hf_import.BIN_FILE)
    return
  names = sorted(state)
  weight_map = {}
  for i in range(shards):
    file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
    part = {n: state[n] for n in names[i::shards]}
    torch.save(part, directory / file)
    weight_map.update({n: file for n in part})
  (directory / hf_import.BIN_INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))


def test_pytorch_bin_single_and_sharded(tmp_path):
  enc, dec = _batch()
  for shards in (1, 3):
    directory = tmp_path / str(shards)
    model = _tiny_hf(directory, seed=shards)
    _as_pytorch_bin(directory, model, shards=shards)
    loaded = model_dirs.load(directory)
    assert loaded.info.format == "hf"
    assert_close(jax_logits(loaded, enc, dec), hf_logits(model, enc, dec))


def test_pytorch_bin_without_torch_is_one_clear_error(tmp_path, monkeypatch):
  _as_pytorch_bin(tmp_path, _tiny_hf(tmp_path))
  monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails.
  with pytest.raises(ValueError, match=r"pytorch_model.bin.*needs torch.*jaxmoral\[torch\]"):
    model_dirs.load(tmp_path)


def test_export_hf_round_trip_through_transformers(tmp_path):
  model = _tiny_hf(tmp_path / "hf", "t5_1_0", seed=1)
  loaded = model_dirs.load(tmp_path / "hf")
  hf_import.export_hf_t5(loaded.params, loaded.config, tmp_path / "export")
  reloaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "export").eval()
  enc, dec = _batch()
  ref = hf_logits(model, enc, dec)
  assert_close(hf_logits(reloaded, enc, dec), ref)
  again = model_dirs.load(tmp_path / "export")
  assert again.config == loaded.config
  assert_close(jax_logits(again, enc, dec), ref)


def test_tied_unscaled_head_of_transformers5_configs(tmp_path):
  """transformers 5 writes T5 1.1 with `tie_word_embeddings: true, scale_decoder_outputs:
  false` and no lm_head when it equals `shared`: logits = hidden @ shared.T, unscaled."""
  torch.manual_seed(2)
  config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                 num_heads=4, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                                 tie_word_embeddings=False)
  model = transformers.T5ForConditionalGeneration(config).eval()
  model.save_pretrained(tmp_path, safe_serialization=True)
  assert json.loads((tmp_path / "config.json").read_text())["scale_decoder_outputs"] is False
  loaded = model_dirs.load(tmp_path)
  assert not loaded.config.tie_word_embeddings
  np.testing.assert_array_equal(loaded.params["decoder"]["logits_dense"]["kernel"],
                                np.asarray(loaded.params["token_embedder"]["embedding"]).T)
  enc, dec = _batch()
  assert_close(jax_logits(loaded, enc, dec), hf_logits(model, enc, dec))


def test_sharded_index_and_bfloat16_files(tmp_path):
  model = _tiny_hf(tmp_path, seed=3)
  model.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True,
                                            max_shard_size="20KB")
  (tmp_path / hf_import.SINGLE_FILE).unlink(missing_ok=True)
  assert (tmp_path / hf_import.INDEX_FILE).is_file()
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
  loaded = model_dirs.load(tmp_path, dtype="bfloat16")
  assert loaded.config.dtype == "bfloat16"
  kernel = loaded.params["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
  assert kernel.dtype == jnp.float32
  expected = model.encoder.block[0].layer[1].DenseReluDense.wi_0.weight.float().detach().numpy()
  np.testing.assert_array_equal(np.asarray(kernel), expected.T)


def _resave(directory, mutate):
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  tensors = load_file(str(directory / hf_import.SINGLE_FILE))
  mutate(tensors)
  save_file(tensors, str(directory / hf_import.SINGLE_FILE))


def test_a_separate_encoder_embedding_is_refused_not_tied(tmp_path):
  _tiny_hf(tmp_path)
  _resave(tmp_path, lambda t: t.update({"encoder.embed_tokens.weight":
                                        t["shared.weight"] + 1.0}))
  with pytest.raises(ValueError, match="encoder.embed_tokens.weight .*differs from shared"):
    model_dirs.load(tmp_path)
  _resave(tmp_path, lambda t: t.update({"encoder.embed_tokens.weight": t["shared.weight"]}))
  assert model_dirs.load(tmp_path).info.format == "hf"  # An identical copy is fine.


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path):
  _tiny_hf(tmp_path, "t5_1_0")
  name = "decoder.block.1.layer.1.EncDecAttention.k.weight"
  _resave(tmp_path, lambda t: t.pop(name))
  with pytest.raises(ValueError, match=f"missing tensors.*{name}.*model.safetensors"):
    model_dirs.load(tmp_path)
  _tiny_hf(tmp_path, "t5_1_0")
  extra = "encoder.block.7.layer.0.SelfAttention.q.weight"
  _resave(tmp_path, lambda t: t.update({extra: np.zeros((32, 32), np.float32)}))
  with pytest.raises(ValueError, match=f"unexpected tensors {extra} .in .*model.safetensors"):
    model_dirs.load(tmp_path)
  _tiny_hf(tmp_path, "t5_1_0")
  bad = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
  _resave(tmp_path, lambda t: t.update({bad: np.zeros((32, 63), np.float32)}))
  with pytest.raises(ValueError, match=rf"{bad} .in .*: shape \(32, 63\), expected \(32, 64\)"):
    model_dirs.load(tmp_path)


def test_config_errors_name_the_field(tmp_path):
  base = hf_import.config_to_hf(T5Config())
  with pytest.raises(ValueError, match="model_type 'bart'"):
    hf_import.config_from_hf({**base, "model_type": "bart"})
  with pytest.raises(ValueError, match=r"missing fields \['d_ff'\]"):
    hf_import.config_from_hf({k: v for k, v in base.items() if k != "d_ff"})
  with pytest.raises(ValueError, match="feed_forward_proj"):
    hf_import.config_from_hf({**base, "feed_forward_proj": "gated-swish"})
  assert hf_import.config_from_hf({**base, "eos_token_id": [1, 5]}).eos_token_id == 1
  # Pre-transformers-5 T5 1.1 configs say "untied" through tie_word_embeddings only.
  old = {k: v for k, v in base.items() if k != "scale_decoder_outputs"}
  assert not hf_import.config_from_hf({**old, "tie_word_embeddings": False}).tie_word_embeddings
  assert hf_import.config_from_hf({k: v for k, v in old.items()
                                   if k != "tie_word_embeddings"}).tie_word_embeddings
  (tmp_path / "config.json").write_text("{not json")
  (tmp_path / hf_import.SINGLE_FILE).write_bytes(b"")
  with pytest.raises(ValueError, match="config.json: invalid JSON"):
    model_dirs.load(tmp_path)


def test_nothing_known_there_lists_what_was_looked_for(tmp_path):
  (tmp_path / "notes.txt").write_text("hi")
  with pytest.raises(FileNotFoundError, match="no model found.*model.safetensors.*params/.*"
                                              "model_config.json.*_METADATA"):
    model_dirs.load(tmp_path)
  with pytest.raises(FileNotFoundError, match="no such model directory"):
    model_dirs.load(tmp_path / "missing" / "dir")


# -- the Hub --------------------------------------------------------------------------------------
def _hub_cache(root, repo_id, source):
  """A Hugging Face Hub cache holding `source`'s files as `repo_id` (the layout the hub keeps)."""
  import shutil  # pylint: disable=g-import-not-at-top
  commit = "0" * 40
  repo = root / f"models--{repo_id.replace('/', '--')}"
  snapshot = repo / "snapshots" / commit
  snapshot.mkdir(parents=True)
  for f in source.iterdir():
    shutil.copyfile(f, snapshot / f.name)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(commit)


def test_a_hub_id_resolves_from_the_local_cache_offline(tmp_path, monkeypatch, demo_vocab_path):
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  model = _tiny_hf(tmp_path / "src", vocab_path=demo_vocab_path)
  _hub_cache(tmp_path / "hub", "jaxmoral-test/t5-tiny", tmp_path / "src")
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.chdir(tmp_path)  # No local folder of that name.
  loaded = model_dirs.load("jaxmoral-test/t5-tiny")
  assert loaded.info.format == "hub" and loaded.vocabulary is not None
  enc, dec = _batch()
  assert_close(jax_logits(loaded, enc, dec), hf_logits(model, enc, dec))
  with pytest.raises(FileNotFoundError) as info:
    model_dirs.load("jaxmoral-test/not-cached")
  message = str(info.value)
  assert "\n" not in message and "not in the cache" in message and "HF_HUB_OFFLINE" in message


# -- T5X ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_t5x_orbax_checkpoint_loads_into_shardings(variant, tmp_path, mesh, caplog):
  """A T5X-layout Orbax checkpoint (params under target/, optimizer state beside) loads."""
  model = _tiny_hf(tmp_path / "hf", variant, seed=4)
  tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  config, params = hf_import.params_from_hf(tensors, model.config.to_dict())
  tree = {"target": params,
          "state": {"step": np.int32(100), "param_states": {"token_embedder": {"embedding": {
              "v_row": np.ones(VOCAB, np.float32)}}}}}
  ocp.PyTreeCheckpointer().save(tmp_path / "checkpoint_100", tree)
  (tmp_path / "checkpoint_100" / "_CHECKPOINT_METADATA").unlink(missing_ok=True)  # As T5X's.
  with caplog.at_level(logging.WARNING):
    loaded = model_dirs.load(tmp_path / "checkpoint_100", partitioner=mesh)
  assert loaded.info.format == "t5x"
  assert "Metadata file does not exist" not in caplog.text  # An item folder has none.
  # Shapes give everything but the defaults (128, 1e-6) that the torch model also uses.
  assert loaded.config == config.replace(dropout_rate=0.0)
  flat = flax.traverse_util.flatten_dict(loaded.params)
  for key, value in flax.traverse_util.flatten_dict(params).items():
    np.testing.assert_array_equal(np.asarray(flat[key]), value)
  assert flat[("decoder", "layers_0", "mlp", "wo", "kernel")].sharding.spec[0] == "model"
  enc, dec = _batch()
  assert_close(jax_logits(loaded, enc, dec), hf_logits(model, enc, dec))


def test_t5x_scanned_and_legacy_checkpoints_are_refused(tmp_path):
  from jaxmoral.models import t5x_import  # pylint: disable=g-import-not-at-top
  scanned = {"target": {"token_embedder": {"embedding": np.zeros((4, 2))},
                        "encoder": {"encoder": {"layers": {"x": np.zeros((2, 3))}}}}}
  with pytest.raises(ValueError, match="scanned"):
    t5x_import.find_param_tree(scanned, "<tree>")
  with pytest.raises(ValueError, match="no T5X parameter tree"):
    t5x_import.find_param_tree({"optimizer": {"state": {}}}, "<tree>")
  (tmp_path / "checkpoint").write_bytes(b"\x80")
  with pytest.raises(ValueError, match="legacy"):
    model_dirs.load(tmp_path)


# -- jaxmoral's own formats ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(hf_t5):
  """(config, host params, vocabulary) of the session's HF tiny T5."""
  loaded = model_dirs.load(hf_t5[0])
  return loaded.config, jax.device_get(loaded.params), loaded.vocabulary


def _same_params(a, b):
  """The same T5 parameters (bit for bit: loading computes nothing)."""
  for x, y in zip(jax.tree.leaves(jax.device_get(a.lm_params)),
                  jax.tree.leaves(jax.device_get(b.lm_params))):
    np.testing.assert_array_equal(x, y)


def test_export_run_step_ppo_and_prompt_runs(tmp_path, tiny, mesh, caplog):
  config, params, vocabulary = tiny
  # An export, with a Diamante-style scalar head and settings.
  head = {"kernel": np.ones((config.d_model, 1), np.float32), "bias": np.zeros(1, np.float32)}
  model_dirs.export(tmp_path / "export", params={**params, "scalar_head": head}, config=config,
                    vocabulary=vocabulary, settings={"data": {"separator": " | "}})
  exported = model_dirs.load(tmp_path / "export", partitioner=mesh)
  assert exported.info.format == "export" and exported.has_scalar_head
  # The language model's parameters: the stored tree without the head, what a T5 applies.
  assert set(exported.lm_params) == set(params) and "scalar_head" in exported.params
  assert exported.settings["data"]["separator"] == " | " and exported.vocabulary is not None
  with pytest.raises(FileExistsError, match="--overwrite"):
    model_dirs.export(tmp_path / "export", params=params, config=config)
  # A run: two steps; the latest by default, any step by RUN/checkpoints/STEP.
  run = tmp_path / "run"
  run_dirs.save_run_files(run, config=config, vocabulary=vocabulary)
  doubled = jax.tree.map(lambda x: 2 * x, params)
  with checkpoints.CheckpointManager(run_dirs.checkpoints_dir(run),
                                     async_save=False) as manager:
    manager.save(1, {"step": np.int32(1), "params": params, "opt_state": {}}, force=True)
    manager.save(2, {"step": np.int32(2), "params": doubled, "opt_state": {}}, force=True)
  with caplog.at_level(logging.WARNING):
    latest = model_dirs.load(run, partitioner=mesh)
  assert latest.info.format == "run" and latest.info.step == 2
  # Orbax reads the item folder as a checkpoint root: its missing-metadata warning is false.
  assert "Metadata file does not exist" not in caplog.text
  np.testing.assert_array_equal(np.asarray(latest.params["token_embedder"]["embedding"]),
                                doubled["token_embedder"]["embedding"])
  first = model_dirs.load(run / "checkpoints" / "1")
  assert first.info.format == "run_step" and first.info.step == 1
  _same_params(first, model_dirs.load(tmp_path / "export"))
  # A PPO run gives its policy.
  ppo = tmp_path / "ppo"
  run_dirs.save_run_files(ppo, config=config, vocabulary=vocabulary)
  with checkpoints.CheckpointManager(run_dirs.checkpoints_dir(ppo),
                                     async_save=False) as manager:
    manager.save(3, {"step": np.int32(3), "policy": {"params": doubled, "step": np.int32(9)},
                     "value": {"params": {**params, "scalar_head": head}},
                     "ref_params": params}, force=True)
  _same_params(model_dirs.load(ppo), latest)
  # A prompt-tuning run gives its base and its prompt.
  prompt_run = tmp_path / "prompt"
  run_dirs.save_run_files(prompt_run, config=config, vocabulary=vocabulary)
  prompt = np.arange(5 * config.d_model, dtype=np.float32).reshape(5, config.d_model)
  with checkpoints.CheckpointManager(run_dirs.checkpoints_dir(prompt_run),
                                     async_save=False) as manager:
    manager.save(4, {"step": np.int32(4), "params": {"base": params, "prompt": prompt}},
                 force=True)
  prompted = model_dirs.load(prompt_run, partitioner=mesh)
  assert prompted.info.prompt_shape == (5, config.d_model)
  np.testing.assert_array_equal(np.asarray(prompted.prompt), prompt)
  _same_params(prompted, first)


def test_export_command_to_jaxmoral_and_hf(tmp_path, tiny, hf_t5):
  from jaxmoral import cli  # pylint: disable=g-import-not-at-top
  config, params, vocabulary = tiny
  run = tmp_path / "run"
  run_dirs.save_run_files(run, config=config, vocabulary=vocabulary)
  with checkpoints.CheckpointManager(run_dirs.checkpoints_dir(run),
                                     async_save=False) as manager:
    manager.save(1, {"step": np.int32(1), "params": params, "opt_state": {}}, force=True)
  assert cli.main(["export", f"--model_dir={run}", f"--output={tmp_path / 'hf'}",
                   "--format=hf"]) == 0
  assert (tmp_path / "hf" / "spiece.model").is_file()
  reloaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
  enc, dec = _batch()
  assert_close(hf_logits(reloaded, enc, dec), hf_logits(hf_t5[1], enc, dec))
  # An existing export is refused without --overwrite, with one line.
  assert cli.main(["export", f"--model_dir={run}", f"--output={tmp_path / 'hf'}",
                   "--format=hf"]) == 2
  assert cli.main(["export", f"--model_dir={run}", f"--output={tmp_path / 'hf'}",
                   "--format=hf", "--overwrite"]) == 0
