"""A byte-level decoder-only transformer LM trained on the Python standard library's sources.

Use it as ``prefect_jax.examples.bytelm:program``, a factory of typed program params
(`ByteLMParams`: a preset, default ``small``, and overrides of its `Config` fields, given with
``--program-param KEY=VALUE`` or a flow's ``program_params``; without any, the environment's
``PREFECT_JAX_BYTELM_PRESET`` and ``PREFECT_JAX_BYTELM_CONFIG`` as a fallback), or name a preset
directly: ``prefect_jax.examples.bytelm:tiny``, ``:small``, ``:gpu100m``.
"""

from prefect_jax.examples.bytelm.config import PRESETS, Config, config_from_env
from prefect_jax.examples.bytelm.corpus import CorpusError
from prefect_jax.examples.bytelm.lm import ByteLMProgram
from prefect_jax.examples.bytelm.model import ByteTransformer
from prefect_jax.examples.bytelm.params import ByteLMParams, program

tiny = ByteLMProgram(PRESETS["tiny"])
small = ByteLMProgram(PRESETS["small"])
gpu100m = ByteLMProgram(PRESETS["gpu100m"])

__all__ = [
    "PRESETS",
    "ByteLMParams",
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
