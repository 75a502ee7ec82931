"""The byte-level LM's `Config`: each field's meaning and range, the presets, and the fallback
that reads a preset and overrides from the environment. What a run's numbers are; `lm` builds
the program from one (`ByteLMProgram`), `params` the typed program params over it."""

from __future__ import annotations

import dataclasses
import json
import numbers
import os

PRESET_ENV = "PREFECT_JAX_BYTELM_PRESET"
CONFIG_ENV = "PREFECT_JAX_BYTELM_CONFIG"


@dataclasses.dataclass(frozen=True)
class Config:
    """One byte-level LM run: the model, the optimizer, the batches and the corpus.

    Args:
        seq_len: tokens per sequence (the corpus is cut into windows of ``seq_len + 1`` bytes).
        d_model, n_layers, n_heads, d_ff: the transformer's widths and depth.
        positions: ``"rope"`` (rotary) or ``"learned"`` (a position table).
        dropout: dropout rate on the embeddings and each residual branch.
        compute_dtype: ``"float32"`` or ``"bfloat16"`` (matmuls; the weights stay float32).
        attention: `jax.nn.dot_product_attention`'s implementation (None: JAX's choice;
            ``"cudnn"``: cuDNN's fused attention on NVIDIA GPUs, bfloat16 only).
        batch_size: sequences per micro-batch.
        grad_accum: micro-batches per update (a train batch holds ``batch_size * grad_accum``).
        eval_batch_size: sequences per eval batch (the last may be smaller; metrics are exact).
        eval_sequences: evaluate this many eval windows, spread evenly over the eval split
            (None: all of them).
        learning_rate: peak learning rate, reached after `warmup_steps`.
        warmup_steps: linear warmup from 0.
        decay_steps: cosine decay to ``learning_rate * min_lr_ratio`` by this step (with warmup).
        min_lr_ratio: the final learning rate as a share of the peak.
        weight_decay: AdamW's decoupled weight decay (matrices only, not norms).
        b1, b2: Adam's moment decays.
        grad_clip: clip the gradient's global norm to this.
        max_files: build the corpus from the first this many source files only (None: all).
        source: the folder of text files the corpus is built from (None:
            ``$PREFECT_JAX_BYTELM_SOURCE`` where set, else the standard library of the interpreter
            running the job). The typed params record the folder the environment gives, and
            each step the digest of the text it was built from, so a rerun on other text is
            refused; the standard library is the same corpus wherever the Python release is the
            same (another release's files differ: a job moved to it is refused).
        suffixes: the file name endings taken from ``source``, comma-separated (``".txt,.md"``;
            default ``".py"``); every file under it, at any depth, that ends with one.
        read_threads: Grain's reading threads for training batches (0: the training thread).
        prefetch: batches Grain reads ahead (with threads).
        mesh: the device mesh, ``{axis: size}`` over the axes ``data`` and ``model`` (None:
            ``{"data": -1}``, every device on one axis): the state is FSDP-sharded over ``data``
            and, with a ``model`` axis, its matmul weights split tensor-parallel over ``model``
            (see `ByteLMProgram.shardings`); another axis is refused.
    """

    seq_len: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    positions: str = "rope"
    dropout: float = 0.1
    compute_dtype: str = "float32"
    attention: str | None = None
    batch_size: int = 16
    grad_accum: int = 1
    eval_batch_size: int = 32
    eval_sequences: int | None = 512
    learning_rate: float = 1e-3
    warmup_steps: int = 200
    decay_steps: int = 20000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    max_files: int | None = None
    source: str | None = None
    suffixes: str = ".py"
    read_threads: int = 2
    prefetch: int = 8
    mesh: dict | None = None

    def __post_init__(self):
        """Refuse values the run could only fail on later (a NaN loss at the first step, an
        evaluation with no batch after the first checkpoint, a string where a number goes, as
        JSON overrides can give), naming the field."""
        for field in dataclasses.fields(self):
            _refuse_unless(self, field.name, _is_a(getattr(self, field.name), field.type), "")
        for name in (
            "seq_len", "d_model", "n_layers", "n_heads", "d_ff", "batch_size", "grad_accum",
            "eval_batch_size", "decay_steps",
        ):  # fmt: skip
            _refuse_unless(self, name, getattr(self, name) >= 1, "must be at least 1")
        for name in ("eval_sequences", "max_files"):
            value = getattr(self, name)
            _refuse_unless(
                self, name, value is None or value >= 1, "must be at least 1, or null (all)"
            )
        for name in ("warmup_steps", "weight_decay", "read_threads", "prefetch"):
            _refuse_unless(self, name, getattr(self, name) >= 0, "must be at least 0")
        for name in ("learning_rate", "grad_clip"):
            _refuse_unless(self, name, getattr(self, name) > 0, "must be above 0")
        for name in ("dropout", "b1", "b2"):
            _refuse_unless(self, name, 0 <= getattr(self, name) < 1, "must be in [0, 1)")
        _refuse_unless(self, "min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]")
        _refuse_unless(
            self,
            "source",
            self.source is None or self.source.strip() != "",
            "must be a folder of text files, or null (the standard library)",
        )
        _refuse_unless(
            self,
            "suffixes",
            all(part.strip() for part in self.suffixes.split(",")),
            "must be file name endings, comma-separated, e.g. '.txt,.md'",
        )
        _refuse_unless(
            self,
            "compute_dtype",
            self.compute_dtype in ("float32", "bfloat16"),
            "use 'float32' or 'bfloat16'",
        )
        _refuse_unless(
            self,
            "attention",
            self.attention in (None, "xla", "cudnn"),
            "use null (JAX's choice), 'xla' or 'cudnn'",
        )
        _refuse_unless(
            self,
            "attention",
            self.attention != "cudnn" or self.compute_dtype == "bfloat16",
            "cuDNN's fused attention takes bfloat16 only: set compute_dtype 'bfloat16', or leave "
            "attention null",
        )
        # `ByteLMProgram.shardings` places the state on these two axes only. Another axis would
        # split nothing of the state (an "fsdp" axis: data parallel, not FSDP; a typo for
        # "model": no tensor parallelism), so it is refused rather than run as something else.
        unknown = sorted(set(self.mesh or {}) - set(MESH_AXES), key=str)
        _refuse_unless(
            self,
            "mesh",
            not unknown,
            f"the byte LM places its state on the axes {MESH_AXES[0]!r} (FSDP, and the batch) "
            f"and {MESH_AXES[1]!r} (tensor parallel) only, not {', '.join(map(repr, unknown))}: "
            'e.g. {"data": -1, "model": 2}',
        )


MESH_AXES = ("data", "model")
"""The mesh axes `ByteLMProgram.shardings` places the state and the batch on."""


def _refuse_unless(config: Config, name: str, holds: bool, rule: str) -> None:
    if not holds:
        field = next(f for f in dataclasses.fields(config) if f.name == name)
        rule = rule or f"must be {field.type.replace(' | None', ', or null')}"
        raise ValueError(f"{name}={getattr(config, name)!r}: {rule}")


_TYPES = {
    "int": numbers.Integral,
    "float": numbers.Real,
    "str": str,
    "bool": bool,
    "dict": dict,
    "list": list,
}
"""The annotations a `Config` field may have (with ``| None``), as written in the class."""


def _is_a(value, annotation: str) -> bool:
    """`value` fits a field's annotation (as written: ``"int | None"``); a bool is no number,
    and a number no bool.

    Raises:
        TypeError: the annotation names a type `_TYPES` does not have (a field added to
            `Config` with another type: add the type to `_TYPES`).
    """
    names = [kind for kind in annotation.split(" | ") if kind != "None"]
    unknown = [kind for kind in names if kind not in _TYPES]
    if unknown:
        raise TypeError(
            f"a Config field annotated {annotation!r}: {', '.join(unknown)} is not a type the "
            f"config checks ({', '.join(_TYPES)}); add it to bytelm.config._TYPES"
        )
    if value is None:
        return "None" in annotation.split(" | ")
    if isinstance(value, bool):
        return "bool" in names
    return any(isinstance(value, _TYPES[kind]) for kind in names)


PRESETS = {
    # A few thousand parameters, sequences of 32 bytes, the first 400 files (of its source,
    # in path order): for tests.
    "tiny": Config(
        seq_len=32,
        d_model=16,
        n_layers=2,
        n_heads=2,
        d_ff=32,
        batch_size=8,
        eval_batch_size=16,
        eval_sequences=64,
        learning_rate=3e-3,
        warmup_steps=10,
        decay_steps=2000,
        max_files=400,
        read_threads=0,
        prefetch=0,
    ),
    # The default: a few million parameters.
    "small": Config(),
    # Over 100M parameters, bfloat16 compute on float32 master weights: a GPU's work.
    "gpu100m": Config(
        seq_len=1024,
        d_model=1024,
        n_layers=8,
        n_heads=16,
        d_ff=4096,
        dropout=0.0,
        compute_dtype="bfloat16",
        batch_size=32,
        eval_batch_size=32,
        eval_sequences=256,
        learning_rate=3e-4,
        warmup_steps=100,
        decay_steps=10000,
        read_threads=8,
        prefetch=16,
    ),
}


def config_from_env(environ=None) -> Config:
    """The preset named by ``PREFECT_JAX_BYTELM_PRESET`` (default ``small``) with the JSON
    overrides in ``PREFECT_JAX_BYTELM_CONFIG``.

    Raises:
        ValueError: an unknown preset or field, or overrides that are not a JSON object.
    """
    environ = os.environ if environ is None else environ
    name = environ.get(PRESET_ENV) or "small"
    if name not in PRESETS:
        raise ValueError(f"${PRESET_ENV}={name!r} is not a preset; use one of {sorted(PRESETS)}")
    raw = environ.get(CONFIG_ENV) or "{}"
    try:
        overrides = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"${CONFIG_ENV}={raw!r} is not JSON ({exc}); "
            "give an object, e.g. '{\"batch_size\": 32}'"
        ) from exc
    if not isinstance(overrides, dict):
        raise ValueError(f"${CONFIG_ENV}={raw!r} must be a JSON object of Config fields")
    fields = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"${CONFIG_ENV} names unknown field(s) {unknown}; fields: {sorted(fields)}"
        )
    return dataclasses.replace(PRESETS[name], **overrides)
