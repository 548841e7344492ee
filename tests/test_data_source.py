"""Tests for jaxmoral.data.source: every training source shares one step-indexed contract and
one implementation of the per-process shard (seqio's `TaskSource`: tests/test_data_tasks.py)."""

import numpy as np
import pytest

from jaxmoral.data import pipeline
from jaxmoral.data import source as source_lib
from jaxmoral.diamante import data as diamante_data
from jaxmoral.rl import ppo_trainer


class CharVocab:
  def encode(self, s):
    return [3 + ord(c) for c in s]


def _turns():
  return [diamante_data.Turn((f"context {i}",), f"human {i}", (f"model {i}",), dialogue=i)
          for i in range(10)]


SOURCES = {
    "BatchSource": lambda **kw: pipeline.BatchSource(
        features={"x": np.arange(10), "y": np.arange(10) * 2}, seed=1, **kw),
    "QuadrupleSource": lambda **kw: diamante_data.QuadrupleSource(
        turns=_turns(), vocab=CharVocab(), seed=1, **kw),
    "PromptSource": lambda **kw: ppo_trainer.PromptSource(
        tokens=np.arange(10)[:, None], texts=[f"p{i}" for i in range(10)], seed=1, **kw),
}


def _rows(batch):
  """A batch's rows as comparable tuples (texts included)."""
  columns = [list(map(str, np.asarray(v).reshape(len(v), -1).tolist())) if not isinstance(v, list)
             else v for _, v in sorted(batch.items())]
  return list(zip(*columns))


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_source_is_step_indexed_and_sharded_alike(name):
  make = SOURCES[name]
  whole = make(batch_size=4)
  assert source_lib.DataSource in type(whole).__mro__
  assert whole.num_examples == 10 and whole.steps_per_epoch == 3
  assert whole.data_fingerprint is None and whole.keeping_position("/unused", 2) is whole
  stream = whole.iterate(0)
  batches = [next(stream) for _ in range(5)]
  # A resume at any step reads what the uninterrupted stream read.
  assert _rows(next(whole.iterate(3))) == _rows(batches[3])
  # Process i of 2 reads part i of every global batch.
  shards = [whole.shard(i, 2) for i in range(2)]
  assert [s.per_shard_batch_size for s in shards] == [2, 2]
  for step, want in enumerate(batches):
    got = _rows(shards[0].batch(step)) + _rows(shards[1].batch(step))
    assert got == _rows(want)
  np.testing.assert_array_equal(shards[1].shard_positions(2), [10, 11])


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_shard_errors_name_the_source(name):
  make = SOURCES[name]
  with pytest.raises(ValueError, match=rf"{name}.batch_size 5 is not divisible by shard_count 2"):
    make(batch_size=5).shard(0, 2)
  with pytest.raises(ValueError, match=rf"{name}.shard_index 2 not in \[0, shard_count=2\)"):
    make(batch_size=4, shard_index=2, shard_count=2)
  with pytest.raises(ValueError, match=rf"{name}.shard: already sharded"):
    make(batch_size=4).shard(0, 2).shard(0, 2)
  with pytest.raises(ValueError, match=rf"{name}.batch_size"):
    make(batch_size=0)
  with pytest.raises(ValueError, match="step must be >= 0"):
    next(make(batch_size=4).iterate(-1))
