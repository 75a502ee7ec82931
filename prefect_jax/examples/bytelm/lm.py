"""The byte-level LM as a prefect-jax program: the model built, the train and eval steps, serving.

The train state is ``{"params", "opt", "rng", "step"}``: float32 master weights, the optax
state (AdamW with warmup + cosine decay after global-norm clipping), the dropout key and the
step count (the learning rate's position in its schedule), so a checkpoint holds every stream
an exact resume needs. A train batch is ``{"tokens": uint8 (batch * grad_accum, seq_len + 1)}``;
the step splits it into ``grad_accum`` micro-batches, sums their gradients in a ``lax.scan`` and
applies one update.

The knobs are the typed program params `prefect_jax.examples.bytelm.params.ByteLMParams` (a
preset of `config.PRESETS` and overrides of its `Config` fields), given to the factory
``prefect_jax.examples.bytelm:program``; the engine records them and refuses a resume with others.
As a fallback where none are given (and for `ByteLMProgram()` built without a config),
``PREFECT_JAX_BYTELM_PRESET`` names a preset (default ``small``) and ``PREFECT_JAX_BYTELM_CONFIG``
holds JSON overrides of its fields, e.g. ``'{"batch_size": 32, "compute_dtype": "bfloat16"}'``.
"""

from __future__ import annotations

import dataclasses
import math
import threading

import grain
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from prefect_jax.examples.bytelm import corpus
from prefect_jax.examples.bytelm.config import Config, config_from_env
from prefect_jax.examples.bytelm.model import VOCAB, ByteTransformer


class ByteLMProgram:
    """The byte-level transformer LM as a prefect-jax program (see `prefect_jax.training.program`).

    Args:
        config: the run's `Config` (default: from the environment, see `config_from_env`).

    Example:
        ```python
        from prefect_jax.examples.bytelm import PRESETS, ByteLMProgram
        import dataclasses
        program = ByteLMProgram(dataclasses.replace(PRESETS["small"], grad_accum=4))
        ```
    """

    def __init__(self, config: Config | None = None):
        self.cfg = cfg = config if config is not None else config_from_env()  # (checked)
        self.dtype = jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else jnp.float32
        self.schedule = optax.warmup_cosine_decay_schedule(
            0.0,
            cfg.learning_rate,
            cfg.warmup_steps,
            max(cfg.decay_steps, cfg.warmup_steps + 1),
            end_value=cfg.learning_rate * cfg.min_lr_ratio,
        )
        # Decay the matrices (embeddings, projections), not the norms' scales.
        decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
        self.tx = optax.chain(
            optax.clip_by_global_norm(cfg.grad_clip),
            optax.adamw(
                self.schedule, cfg.b1, cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask
            ),
        )
        self._corpus, self._corpus_lock = None, threading.Lock()
        # The model's structure, traced once on first use (`graphdef`, `param_count`): a trace
        # costs a noticeable part of a second, and building a program (each preset at import, the
        # engine's checks before a run) must not pay it.
        self._structure, self._structure_lock = None, threading.Lock()

    def _abstract_structure(self) -> tuple:
        with self._structure_lock:  # (the engine's compile thread may ask at the same time)
            if self._structure is None:
                abstract = nnx.eval_shape(lambda: self._model(nnx.Rngs(0)))
                graphdef, params = nnx.split(abstract, nnx.Param)
                count = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
                self._structure = (graphdef, count)
            return self._structure

    @property
    def graphdef(self):
        """The model's NNX graph definition (`apply` merges the params into it)."""
        return self._abstract_structure()[0]

    @property
    def param_count(self) -> int:
        """How many weights the model has."""
        return self._abstract_structure()[1]

    def _model(self, rngs):
        c = self.cfg
        return ByteTransformer(
            c.seq_len,
            c.d_model,
            c.n_layers,
            c.n_heads,
            c.d_ff,
            c.positions,
            self.dtype,
            c.attention,
            rngs=rngs,
        )

    @property
    def config(self) -> dict:
        config = {"model": "bytelm", **dataclasses.asdict(self.cfg)}
        config.pop("mesh")  # where the state lives, not what it is: a job resumes on any mesh
        return config

    @property
    def mesh_axes(self) -> dict:
        """The mesh the engine builds (`prefect_jax.training.sharding.build_mesh`)."""
        return dict(self.cfg.mesh) if self.cfg.mesh is not None else {"data": -1}

    def shardings(self, abstract_state, mesh):
        """FSDP over ``data`` (`sharding.fsdp`); with a ``model`` axis, the attention and MLP
        weights (and their Adam moments) also split tensor-parallel over it (Megatron's
        column-then-row layout)."""
        from jax.sharding import PartitionSpec as P

        from prefect_jax.training import sharding

        base = None
        if "model" in mesh.shape:
            column, row = P(None, "model"), P("model", None)
            rules = [(r"(qkv|up)/kernel$", column), (r"(proj|down)/kernel$", row)]
            base = sharding.by_path(abstract_state, rules + [(r"head/kernel$", column)])
        if "data" not in mesh.shape:
            return base
        return sharding.fsdp(abstract_state, mesh, axis="data", base=base)

    @property
    def read_options(self):
        """Grain reads training batches with `Config.read_threads` threads, `prefetch` ahead."""
        threads = self.cfg.read_threads
        return grain.ReadOptions(
            num_threads=threads, prefetch_buffer_size=self.cfg.prefetch if threads else 0
        )

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per matmul weight (forward and backward) plus attention's
        ``12 * layers * seq_len * d_model`` (PaLM's count; the causal half is not subtracted).
        The input embeddings are lookups, not matmuls, and do not count."""
        c = self.cfg
        lookups = VOCAB * c.d_model + (c.seq_len * c.d_model if c.positions == "learned" else 0)
        return 6.0 * (self.param_count - lookups) + 12.0 * c.n_layers * c.seq_len * c.d_model

    # -- the contract -------------------------------------------------------------------

    def init(self, rng):
        # (traced by the engine's checks before a run; else it fails at the first step)
        if self.cfg.attention == "cudnn" and jax.default_backend() != "gpu":
            raise ValueError(
                f"attention='cudnn' runs on NVIDIA GPUs only, and JAX's backend here is "
                f"{jax.default_backend()!r}: leave attention null (JAX's choice), or run on a GPU"
            )
        init_rng, dropout_rng = jax.random.split(rng)
        model = self._model(nnx.Rngs(params=init_rng))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return {
            "params": params,
            "opt": self.tx.init(params),
            "rng": dropout_rng,
            "step": jnp.zeros((), jnp.int32),
        }

    def apply(self, params, tokens, rng=None):
        """Next-token logits (float32) for int token ids (batch, seq); dropout with an `rng`."""
        return nnx.merge(self.graphdef, params)(tokens, self.cfg.dropout, rng)

    def _loss(self, params, tokens, rng):
        tokens = tokens.astype(jnp.int32)
        logits = self.apply(params, tokens[:, :-1], rng)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def train_step(self, state, batch):
        rng, step_rng = jax.random.split(state["rng"])
        k = self.cfg.grad_accum
        tokens = batch["tokens"]
        grad_fn = jax.value_and_grad(self._loss)
        if k == 1:
            loss, grads = grad_fn(state["params"], tokens, step_rng)
        else:
            # Micro-batch j is rows j, j + k, ...: spread over the data axis as the batch is, so
            # each device feeds its own rows to every micro-step (contiguous blocks would move
            # tokens between devices).
            micro = tokens.reshape(tokens.shape[0] // k, k, tokens.shape[1]).swapaxes(0, 1)
            keys = jax.random.split(step_rng, k)

            def accumulate(carry, xs):
                loss, grads = grad_fn(state["params"], *xs)
                return jax.tree.map(jnp.add, carry, (loss, grads)), None

            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state["params"]))
            (loss, grads), _ = jax.lax.scan(accumulate, zeros, (micro, keys))
            loss, grads = jax.tree.map(lambda g: g / k, (loss, grads))
        updates, opt = self.tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "learning_rate": self.schedule(state["step"]),
        }
        return {"params": params, "opt": opt, "rng": rng, "step": state["step"] + 1}, metrics

    def eval_step(self, state, batch):
        """Sums and counts over the batch's tokens: mean loss (nats), bits per byte, accuracy.
        Perplexity is ``exp`` of the aggregated loss (`derive_metrics`: not a sum)."""
        tokens = batch["tokens"].astype(jnp.int32)
        logits = self.apply(state["params"], tokens[:, :-1])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        correct = (logits.argmax(-1) == tokens[:, 1:]).astype(jnp.float32)
        n = jnp.asarray(losses.size, jnp.float32)
        return {
            "loss": (losses.sum(), n),
            "bits_per_byte": (losses.sum() / math.log(2), n),
            "accuracy": (correct.sum(), n),
        }

    def derive_metrics(self, means: dict[str, float]) -> dict[str, float]:
        """Perplexity, ``exp`` of the mean loss over every evaluated token (exact: from the
        aggregated loss, not a mean of per-batch perplexities)."""
        return {"perplexity": math.exp(min(means["loss"], 700.0))}  # (700: exp's float range)

    @property
    def tokens_per_step(self) -> int:
        """Tokens one train step learns from (the engine's ``tokens_per_sec``)."""
        return self.cfg.batch_size * self.cfg.grad_accum * self.cfg.seq_len

    def corpus(self) -> corpus.Corpus:
        """The corpus for this config's sequence length (built on first use; see `corpus.build`)."""
        with self._corpus_lock:  # the engine's compile thread may ask at the same time
            if self._corpus is None:
                self._corpus = corpus.build(
                    self.cfg.seq_len,
                    self.cfg.max_files,
                    source=self.cfg.source,
                    suffixes=tuple(part.strip() for part in self.cfg.suffixes.split(",")),
                )
        return self._corpus

    def data_fingerprint(self) -> str:
        """What the corpus is, ending with the digest of its records (`corpus.Corpus.digest`): a
        job resumed on other text (a file of its folder changed, added or removed) is refused,
        the same text built again on another machine resumes."""
        built = self.corpus()
        files, windows = sum(map(len, built.files.values())), built.windows
        return (
            f"{files} files, {windows['train']} train and {windows['eval']} eval windows of "
            f"{built.window} bytes, digest {built.digest}"
        )

    def train_data(self, seed: int):
        return corpus.train_dataset(self.corpus(), self.cfg.batch_size * self.cfg.grad_accum, seed)

    def eval_data(self):
        return corpus.eval_dataset(self.corpus(), self.cfg.eval_batch_size, self.cfg.eval_sequences)

    # -- serving ------------------------------------------------------------------------

    def serving_input(self):
        """int32 token ids (batch, seq): both symbolic, the sequence at most the context it was
        trained on (the learned position table's size; rotary positions past it were never
        seen)."""
        shape = jax.export.symbolic_shape("b, seq", constraints=(f"seq <= {self.cfg.seq_len}",))
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    def serving_input_range(self):
        """Byte ids: the pyfunc refuses others (the embedding would look them up as NaN)."""
        return (0, VOCAB)

    def serve(self, state, tokens):
        """Next-token logits, float32 (batch, seq, 256), for int32 token ids (batch, seq)."""
        return self.apply(state["params"], tokens)

    def serving_example(self):
        import numpy as np

        text = b"def main():\n    print('hello')\n"
        row = np.frombuffer(text.ljust(self.cfg.seq_len)[: self.cfg.seq_len], np.uint8)
        return np.stack([row, row[::-1]]).astype(np.int32)
