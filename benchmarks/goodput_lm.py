"""`goodput.py --model lm`: the byte LM's three systems, the same job and the same data for each.

The job: ``prefect_jax.examples.bytelm``'s ``small`` preset (a 3.3M-parameter 4-layer
transformer over 256-byte windows) with the overrides of `LM_PARAMS`: a micro-batch of 4 windows
(the preset's 16 makes a step of seconds on two shared cores: too few checkpoint intervals fit
in a preemption period), learned positions (Keras has no rotary attention layer), 32 eval
windows per evaluation and a 30-step warmup (the job is about a hundred steps). ``decay_steps`` is
left unset, so the cosine horizon is the job's --steps on every side.

Data: the example's corpus shards under the cache folder (the standard library's sources, split
train/eval by file), built once by the harness before any clock starts.

- ``prefect_jax``: ``prefect-jax run --program prefect_jax.examples.bytelm:program`` with a
  ``--program-param`` per `LM_PARAMS` entry.
- ``plain``: `benchmarks/lm_bare.py`'s bare loop (its CheckpointManager of the state and the Grain
  iterator, its eval), made resumable: it restores the newest step and the iterator's position,
  and, as prefect-jax does, evaluates that step first where a kill interrupted its evaluation
  (each evaluation's metrics are appended to ``evaluations.jsonl`` as it ends). No SIGTERM
  handler, as such loops are written.
- ``keras``: `keras_model`, Keras 3 ``fit`` on JAX with ``BackupAndRestore`` (one epoch =
  --every steps) over the same windows: the first --steps batches of the same Grain order, read
  into memory once, fed by index (`Windows`), so a resume at an epoch boundary continues with
  the very batches an uninterrupted run would train on; validation over the same eval windows.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = "prefect_jax.examples.bytelm:program"
LM_PARAMS = {
    "preset": "small",
    "batch_size": 4,
    "positions": "learned",
    "eval_sequences": 32,
    "warmup_steps": 30,
}
"""The byte LM's program params for every system (``--lm-params`` JSON overrides them)."""


def lm_params(args) -> dict:
    return {**LM_PARAMS, **json.loads(args.lm_params or "{}")}


def make_program(args):
    """The `ByteLMProgram` the prefect-jax command builds from the same params and --steps."""
    sys.path.insert(0, os.path.dirname(HERE))
    from prefect_jax.examples import bytelm

    return bytelm.program(bytelm.ByteLMParams(**lm_params(args), max_steps=args.steps))


def build_corpus(args) -> dict:
    """Build (or find) the corpus before any clock starts; what the result records of the job."""
    program = make_program(args)
    corpus = program.corpus()
    return {
        "params": lm_params(args),
        "param_count": program.param_count,
        "corpus": {
            "train_windows": corpus.windows["train"],
            "eval_windows": sum(len(b["tokens"]) for b in program.eval_data()),
        },
        "tokens_per_step": program.tokens_per_step,
    }


def prefect_jax_command(args, workdir: str) -> list[str]:
    """`goodput_jobs.prefect_jax_command` of the byte LM, with a ``--program-param`` per param."""
    from goodput_jobs import prefect_jax_command as command

    params = [x for k, v in lm_params(args).items() for x in ("--program-param", f"{k}={v}")]
    return command(args, workdir, ["--program", PROGRAM, *params])


def child_plain(args) -> None:
    """`lm_bare.py`'s bare loop, resumed from its newest checkpoint (state and Grain position)."""
    from goodput_peers import mark, process_start, use_compile_cache

    mark(args.workdir, event="start", process_start=process_start())
    import jax
    import lm_bare as bare

    use_compile_cache(args.workdir)
    mark(args.workdir, event="imported")
    program = make_program(args)
    step_fn = jax.jit(program.train_step, donate_argnums=(0,))
    eval_fn = jax.jit(program.eval_step)
    it = iter(program.train_data(0).to_iter_dataset(program.read_options))
    mgr = bare.manager(os.path.join(args.workdir, "checkpoints"))
    step = mgr.latest_step()
    if step is None:
        state, step = jax.jit(program.init)(jax.random.key(0)), 0
    else:
        state = bare.restore(mgr, step, program, it)
    mark(args.workdir, event="restored", step=int(step))
    evaluations = os.path.join(args.workdir, "evaluations.jsonl")

    def evaluate(step: int) -> None:
        metrics = bare.evaluate(eval_fn, state, program)
        with open(evaluations, "a") as f:
            # (a newline first: a line a kill cut short stays a line of its own)
            f.write("\n" + json.dumps({"step": step, **metrics}))

    if step > 0 and step not in _evaluated_steps(evaluations):
        began = time.time()
        evaluate(step)  # (its seconds are not the restart's: `goodput_jobs.breakdown`)
        mark(args.workdir, event="evaluated_again", step=int(step), secs=time.time() - began)
    first = True
    while step < args.steps:
        state, _ = step_fn(state, next(it))
        step += 1
        if first:
            jax.block_until_ready(state)
            mark(args.workdir, event="first_step")
            first = False
        if step % args.every == 0 or step == args.steps:
            mgr.save(step, args=bare.save_args(state, it))
            evaluate(step)
    mgr.wait_until_finished()
    mgr.close()
    mark(args.workdir, event="done", step=step)


def _evaluated_steps(path: str) -> set[int]:
    """The steps whose evaluation ended (a line cut short by a kill is no evaluation)."""
    steps = set()
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    steps.add(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    pass
    return steps


def keras_model(cfg, keras):
    """The byte LM in Keras 3: byte embedding plus a learned position table, pre-norm blocks
    (RMSNorm, causal MultiHeadAttention without biases, RMSNorm, a tanh-GELU MLP without biases,
    dropout on each branch's output), a final RMSNorm and a 256-way head without bias: the same
    weights as the Flax model with learned positions (the counts are compared in the result)."""
    L = keras.layers

    class Positions(L.Layer):
        def build(self, shape):
            self.table = self.add_weight(
                shape=(shape[1], shape[2]), initializer=keras.initializers.RandomNormal(stddev=1.0)
            )

        def call(self, x):
            return x + keras.ops.expand_dims(self.table, 0)

    def gelu(v):
        return keras.activations.gelu(v, approximate=True)  # jax.nn.gelu's default

    tokens = keras.Input((cfg.seq_len,), dtype="int32")
    x = L.Dropout(cfg.dropout)(Positions()(L.Embedding(256, cfg.d_model)(tokens)))
    for _ in range(cfg.n_layers):
        h = L.RMSNormalization(epsilon=1e-6)(x)
        h = L.MultiHeadAttention(cfg.n_heads, cfg.d_model // cfg.n_heads, use_bias=False)(
            h, h, use_causal_mask=True
        )
        x = L.Add()([x, L.Dropout(cfg.dropout)(h)])
        h = L.Dense(cfg.d_ff, use_bias=False, activation=gelu)(L.RMSNormalization(epsilon=1e-6)(x))
        x = L.Add()([x, L.Dropout(cfg.dropout)(L.Dense(cfg.d_model, use_bias=False)(h))])
    logits = L.Dense(256, use_bias=False)(L.RMSNormalization(epsilon=1e-6)(x))
    return keras.Model(tokens, logits)


def child_keras(args) -> None:
    from goodput_peers import mark, process_start, use_compile_cache

    mark(args.workdir, event="start", process_start=process_start())
    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    import numpy as np

    use_compile_cache(args.workdir)
    mark(args.workdir, event="imported")
    program = make_program(args)
    cfg = program.cfg
    # The same windows in the same order as the other systems' Grain iterator.
    it = iter(program.train_data(0).to_iter_dataset(program.read_options))
    train = np.stack([next(it)["tokens"] for _ in range(args.steps)])
    evals = np.concatenate([b["tokens"] for b in program.eval_data()])

    def split(t):
        return t[..., :-1].astype(np.int32), t[..., 1:].astype(np.int32)

    class Windows(keras.utils.PyDataset):
        """Batch `offset + i` of the job; `offset` is set where an epoch (re)starts."""

        def __init__(self):
            super().__init__()
            self.offset = 0

        def __len__(self):
            return args.steps

        def __getitem__(self, i):
            # (Keras reads a few batches ahead, past the job's last: never trained on.)
            return split(train[(self.offset + i) % args.steps])

    data = Windows()
    keras.utils.set_random_seed(0)
    model = keras_model(cfg, keras)
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0,
        max(1, args.steps - cfg.warmup_steps),  # optax's horizon counts the warmup in
        alpha=cfg.min_lr_ratio,
        warmup_target=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
    )
    optimizer = keras.optimizers.AdamW(
        schedule,
        weight_decay=cfg.weight_decay,
        beta_1=cfg.b1,
        beta_2=cfg.b2,
        epsilon=1e-8,
        global_clipnorm=cfg.grad_clip,
    )
    norms = [
        w
        for layer in model.layers
        if isinstance(layer, keras.layers.RMSNormalization)
        for w in layer.weights
    ]
    optimizer.exclude_from_weight_decay(var_list=norms)  # as the program's mask: matrices only
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    workdir, every = args.workdir, args.every
    with open(os.path.join(workdir, "keras_params.json"), "w") as f:
        json.dump({"keras": model.count_params(), "flax": program.param_count}, f)

    class Marks(keras.callbacks.Callback):
        first, step = True, None

        def on_epoch_begin(self, epoch, logs=None):
            # BackupAndRestore (listed before) restored the weights and the epoch by now; the
            # batches are drawn after this call, so the first one is the epoch's first.
            if self.step is None:
                self.step = data.offset = epoch * every
                mark(workdir, event="restored", step=self.step)

        def on_train_batch_end(self, batch, logs=None):
            self.step += 1
            if self.first:
                mark(workdir, event="first_step")
                self.first = False

    marks = Marks()
    backup = keras.callbacks.BackupAndRestore(
        backup_dir=os.path.join(workdir, "backup"), save_freq="epoch", delete_checkpoint=False
    )
    model.fit(
        data,
        epochs=args.steps // every,
        steps_per_epoch=every,
        validation_data=split(evals),
        validation_batch_size=cfg.eval_batch_size,
        callbacks=[backup, marks],
        verbose=0,
    )
    mark(workdir, event="done", step=marks.step)
