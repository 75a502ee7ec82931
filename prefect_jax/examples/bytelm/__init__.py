"""A byte-level decoder-only transformer LM trained on the Python standard library's sources.

Use it as ``prefect_jax.examples.bytelm:program`` (the preset in ``PREFECT_JAX_BYTELM_PRESET``,
default ``small``, with the JSON overrides in ``PREFECT_JAX_BYTELM_CONFIG``), or name a preset
directly: ``prefect_jax.examples.bytelm:tiny``, ``:small``, ``:gpu100m``.
"""

from prefect_jax.examples.bytelm.corpus import CorpusError
from prefect_jax.examples.bytelm.lm import PRESETS, ByteLMProgram, Config, config_from_env
from prefect_jax.examples.bytelm.model import ByteTransformer

program = ByteLMProgram()
tiny = ByteLMProgram(PRESETS["tiny"])
small = ByteLMProgram(PRESETS["small"])
gpu100m = ByteLMProgram(PRESETS["gpu100m"])

__all__ = [
    "PRESETS",
    "ByteLMProgram",
    "ByteTransformer",
    "Config",
    "CorpusError",
    "config_from_env",
    "program",
    "tiny",
    "small",
    "gpu100m",
]
