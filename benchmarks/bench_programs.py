"""Programs for the benchmarks, importable as ``bench_programs:<name>``
once this folder is on sys.path."""

from prefect_jax.examples.digits import DigitsProgram

mlp = DigitsProgram(hidden=(256, 256), batch_size=128, dropout=0.0)
"""64-256-256-10 MLP on scikit-learn digits, no dropout."""

wide = DigitsProgram(hidden=(1024, 1024), batch_size=256, dropout=0.0)
"""64-1024-1024-10 MLP, batch 256: the goodput benchmark's job (`goodput.py`)."""
