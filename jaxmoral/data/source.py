"""The data contracts of training: the step-indexed `DataSource`, and the `DataSpec` making it.

Every training source subclasses `DataSource` for its one implementation of sharding: frozen
dataclasses with `batch_size` (global), `shard_index` and `shard_count` fields that call
`check_shard()` in `__post_init__`; process i of n reads part i of every batch.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, ClassVar, Iterator, Mapping, Optional, Protocol

import numpy as np

from jaxmoral import fileio
from jaxmoral import validation


class DataSource(Protocol):
  """Batch `step` of this process's shard, deterministic in the step: a run resumed at step
  k reads batch k next, what the uninterrupted run read, at the same cost at any k.

  Attributes:
    batch_size: The *global* batch size (a checkpoint records it: the step is the position).
    shard_index: This process's shard of every global batch.
    shard_count: Number of shards (processes).
  """
  batch_size: int
  shard_index: int
  shard_count: int

  @property
  def num_examples(self) -> Optional[int]:
    """Examples of one pass (all shards), or None when the source does not know."""

  @property
  def steps_per_epoch(self) -> int:
    """Steps until every example was served once: ceil(num_examples / batch_size) (0: unknown)."""
    return -(-(self.num_examples or 0) // self.batch_size)

  @property
  def data_fingerprint(self) -> Optional[str]:
    """A hash of the rows served, or None (checkpointed: a resume over other data is refused)."""
    return None

  def batch(self, step: int) -> dict[str, Any]:
    """This shard's rows of global batch `step` (a source defines `batch` or `iterate`)."""
    return next(self.iterate(step))

  def iterate(self, start_step: int = 0) -> Iterator[dict[str, Any]]:
    """batch(start_step), batch(start_step + 1), ... forever."""
    return map(self.batch, itertools.count(start_step))

  def eval_batches(self) -> Iterator[dict[str, Any]]:
    """One pass: the first `steps_per_epoch` batches (the last may run into the next epoch)."""
    return map(self.batch, range(self.steps_per_epoch))

  def keeping_position(self, directory: str, every: int) -> DataSource:
    """This source keeping its iterator state (if any: a streamed `tasks.TaskSource`) under
    `directory` every `every` steps; one whose position is the step alone is returned."""
    del directory, every
    return self

  def check_shard(self) -> None:
    """Raises a ValueError naming the source for a bad batch size or shard."""
    name = type(self).__name__
    validation.positive_int(self.batch_size, f"{name}.batch_size")
    if self.shard_count < 1 or not 0 <= self.shard_index < self.shard_count:
      raise ValueError(f"{name}.shard_index {self.shard_index} not in "
                       f"[0, shard_count={self.shard_count})")
    if self.batch_size % self.shard_count:
      raise ValueError(f"{name}.batch_size {self.batch_size} is not divisible by "
                       f"shard_count {self.shard_count}")

  @property
  def per_shard_batch_size(self) -> int:
    return self.batch_size // self.shard_count

  def shard_positions(self, step: int) -> np.ndarray:
    """Stream positions (int64) of this shard's part of global batch `step`, the positions
    `[step * batch_size, (step + 1) * batch_size)`."""
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    per = self.per_shard_batch_size
    return step * self.batch_size + self.shard_index * per + np.arange(per, dtype=np.int64)

  def shard(self, process_index: int, process_count: int) -> DataSource:
    """The same stream, serving process `process_index`'s shard of every global batch."""
    if self.shard_count != 1:
      raise ValueError(f"{type(self).__name__}.shard: already sharded")
    return dataclasses.replace(self, shard_index=process_index,  # type: ignore[type-var]
                               shard_count=process_count)


class DataSpec(Protocol):
  """Where a run's batches come from (gin injects one into `runs.train_run`)."""
  FILE_FIELDS: ClassVar[tuple[str, ...]] = ()  # The fields that name files (`check_files`).

  def vocabulary(self, vocab_dir: str, *, fallback: Any = None) -> Any:
    """The vocabulary: the one the data names, else `fallback` (the init checkpoint's), else
    one built into `vocab_dir`."""

  def sources(self, *, vocabulary: Any, batch_size: int, feature_lengths: Mapping[str, int],
              seed: int) -> tuple[DataSource, Optional[DataSource]]:
    """(train source, eval source with `eval_batches()` or None)."""

  def settings(self) -> dict[str, Any]:
    """What inference needs to know about the data (saved in settings.json["data"])."""

  def resumed(self, saved: Mapping[str, Any]) -> DataSpec:
    """This data as a resumed run reads it, given its saved `settings()` ({}: none): what
    fixes a run's examples (its held-out split) stays the run's own (default: unchanged)."""
    del saved
    return self

  def batch_shapes(self, *, batch_size: int, feature_lengths: Mapping[str, int]
                   ) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Global batch shapes and dtypes, as `sources` would batch (`jaxmoral compile`)."""

  def check_files(self) -> None:
    """The files of `FILE_FIELDS` exist (checked when used: `jaxmoral compile` needs none)."""
    for name in self.FILE_FIELDS:
      value = getattr(self, name)
      if value is not None and not fileio.isfile(value):
        raise ValueError(f"{type(self).__name__}.{name}: no such file {value!r}")
