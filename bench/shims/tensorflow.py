"""An empty stand-in for `tensorflow` beside `shims/seqio.py` (see there): jaxmoral's data
modules import TensorFlow at the top, and the benchmarks that run with these shims never call
it. Any use raises, so a benchmark cannot silently run on it."""


def __getattr__(name: str):
  raise ImportError(f"tensorflow.{name}: TensorFlow is not installed here; bench/shims "
                    "stands in for it only where no code path needs it")
