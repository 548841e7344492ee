"""Data: readers with line-numbered errors, SentencePiece vocabularies, the bundled demo corpus,
T5X feature conversion with deterministic batching, and seqio Tasks."""

# seqio imports TensorFlow, whose start-up lines (oneDNN, CUDA drivers) would reach a library
# user's stderr: import it once here with them filtered, as the command line does.
import sys as _sys  # noqa: E402

from jaxmoral import runtime as _runtime  # noqa: E402

if "tensorflow" not in _sys.modules:
  _runtime.tensorflow_for_input_pipelines_only(hide_gpus=False)
