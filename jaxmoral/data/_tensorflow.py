"""Imported before seqio, for its effect: TensorFlow's start-up lines are filtered out of stderr,
and in the command line's processes it gets no GPU (`runtime.tensorflow_for_input_pipelines_only`).
Only the modules that define seqio Tasks import it, so nothing else loads TensorFlow."""

import sys

from jaxmoral import runtime

if "tensorflow" not in sys.modules:  # Else the user (or a test) imported it already, as wanted.
  runtime.tensorflow_for_input_pipelines_only()
