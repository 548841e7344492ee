"""A run's TensorBoard files (MODEL_DIR/train/, eval/): written, read back without TensorBoard
(a notebook, a test, the explorer), and cut at the step a killed run resumes from.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import sys
import time
from typing import Any, Iterator, Mapping

import jax

from jaxmoral import fileio
from jaxmoral import run_layout

logger = logging.getLogger(__name__)


def _import_tensorboardx() -> None:
  """Imports tensorboardX without PyTorch.

  tensorboardX's package import loads torch whenever it is installed (about 1.5 s and 180 MiB
  of a training process's memory), only so that it may accept torch tensors, which jaxmoral
  never passes it. Blocked for that import alone; torch stays importable afterwards.
  """
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    return
  sys.modules["torch"] = None  # type: ignore[assignment]  # Makes `import torch` fail.
  try:
    import tensorboardX  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  finally:
    del sys.modules["torch"]


class MetricWriters:
  """TensorBoard event files in train/ and eval/, on process 0 only (shared by every loop).

  A point is in its file when `scalars` or `text` returns: written and flushed in the
  caller's thread (tensorboardX's `SummaryWriter` hands events to a thread its `flush` does not
  wait for, so a run killed after a checkpoint would lose that step's points for good).
  """

  def __init__(self, model_dir: str):
    self._writers = {}
    if jax.process_index() == 0:
      _import_tensorboardx()
      # pylint: disable=g-import-not-at-top  (optional, heavy)
      from tensorboardX.event_file_writer import EventsWriter
      from tensorboardX.record_writer import directory_check
      for name in run_layout.TENSORBOARD_DIRS:
        directory = fileio.join(model_dir, name)
        directory_check(directory)  # Local folders and gs:// / s3:// alike.
        # pid and object id in the name: two writers started in the same second (a run and
        # its quick resume, or two loops of one process) must not share a file.
        self._writers[name] = EventsWriter(fileio.join(directory, "events"),
                                           filename_suffix=f".{os.getpid()}.{id(self)}")

  def _write(self, name: str, step: int, summary: Any) -> None:
    writer = self._writers.get(name)
    if writer is not None:
      from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
      writer.write_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
      writer.flush()

  def scalars(self, name: str, step: int, values: Mapping[str, float]) -> None:
    _import_tensorboardx()
    from tensorboardX.proto import summary_pb2  # pylint: disable=g-import-not-at-top
    self._write(name, step, summary_pb2.Summary(value=[
        summary_pb2.Summary.Value(tag=key, simple_value=float(value))
        for key, value in values.items()]))

  def text(self, name: str, step: int, tag: str, text: str) -> None:
    """Text (e.g. a markdown table of sample outputs) under `name`."""
    _import_tensorboardx()
    from tensorboardX import summary  # pylint: disable=g-import-not-at-top
    self._write(name, step, summary.text(tag, text))

  def close(self) -> None:
    for writer in self._writers.values():
      writer.close()


def _event_files(directory: str) -> list[str]:
  """The paths of a directory's TensorBoard event files, in name order."""
  paths = [fileio.join(directory, name) for name in sorted(fileio.listdir(directory))
           if "tfevents" in name]
  return [path for path in paths if fileio.isfile(path)]


def _records(data: bytes) -> Iterator[bytes]:
  """Each whole TFRecord of an event file's bytes (length, its CRC, the event, its CRC);
  stops at a record a kill cut short."""
  pos = 0
  while pos + 12 <= len(data):
    (length,) = struct.unpack("<Q", data[pos:pos + 8])
    end = pos + 12 + length + 4
    if end > len(data):
      return
    yield data[pos:end]
    pos = end


def _events(directory: str) -> Iterator[Any]:
  """The TensorBoard events of a directory's event files (in name order), without TensorBoard."""
  _import_tensorboardx()
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  for path in _event_files(directory):
    for record in _records(fileio.read_bytes(path)):
      yield event_pb2.Event.FromString(record[12:-4])


def read_scalars(directory: str) -> dict[str, dict[int, float]]:
  """`{tag: {step: value}}` of the scalars in a directory's TensorBoard event files.

  A later point of a step wins (a resumed run drops the points after its checkpoint first:
  `purge_events_after`).
  """
  out: dict[str, dict[int, float]] = {}
  for event in _events(directory):
    for value in event.summary.value:
      if value.HasField("simple_value"):
        out.setdefault(value.tag, {})[event.step] = value.simple_value
  return out


def read_texts(directory: str) -> dict[str, dict[int, str]]:
  """`{tag: {step: text}}` of the text summaries (`MetricWriters.text`) in a directory's
  event files; tags as written (`config`, not TensorBoard's `config/text_summary`)."""
  out: dict[str, dict[int, str]] = {}
  for event in _events(directory):
    for value in event.summary.value:
      if value.tag.endswith("/text_summary") and value.tensor.string_val:
        tag = value.tag[:-len("/text_summary")]
        out.setdefault(tag, {})[event.step] = value.tensor.string_val[0].decode()
  return out


def purge_events_after(directory: str, step: int) -> int:
  """Drops the events of steps after `step` from `directory`'s event files (absent is fine);
  returns how many.

  A run killed after its last checkpoint had already written points past it; the resumed run
  writes those steps again, and TensorBoard would show both. Each file that loses events is
  rewritten whole (the records copied byte for byte, CRCs included). A record cut short by the
  kill is dropped too.
  """
  _import_tensorboardx()
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  if not fileio.isdir(directory):
    return 0
  dropped = 0
  for path in _event_files(directory):
    data = fileio.read_bytes(path)
    records, kept = list(_records(data)), []
    for record in records:
      with contextlib.suppress(Exception):  # A garbled record: dropped.
        if event_pb2.Event.FromString(record[12:-4]).step <= step:
          kept.append(record)
    dropped += len(records) - len(kept)
    # Also rewritten: a file whose last record (or header) a kill tore.
    if len(kept) < len(records) or sum(map(len, records)) != len(data):
      fileio.write_bytes(path, b"".join(kept))  # Whole: a temporary renamed over, or one object.
  if dropped:
    logger.info("train: dropped %d TensorBoard events after step %d in %s", dropped, step,
                directory)
  return dropped
