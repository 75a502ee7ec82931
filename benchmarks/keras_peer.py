"""Keras peer of run.py's plain side: the same training work with Keras 3 `fit` on JAX.

The same 64-256-256-10 MLP (ReLU, no dropout), Adam 1e-3, sparse categorical cross-entropy from
logits, batch 128, on scikit-learn digits for --steps steps; every --every steps a
`keras.callbacks.BackupAndRestore` backup and a full evaluation on the 360-image test split.
One Keras epoch is exactly --every steps: the training array is every*128 rows of concatenated
shuffled permutations of the train split, fed with shuffle=False; the test split is one
360-row validation batch. Keras defaults are kept (jit_compile="auto",
so XLA; steps_per_execution=1).

import_s (not counted) imports keras, jax and the digits program. wall_s covers everything
after: data, model build, compile, training, evals and backups, until `fit` returns.
loop_s runs from the end of the first training batch to the return of `fit`. Keras's JAX
dispatch is async, but a callback overriding `on_train_batch_end` (BackupAndRestore does, so
does our probe) makes Keras call it synchronously with the logs converted to Python floats,
which waits for the step: so the clock read there comes after batch 0 has finished.

A probe callback checks the work is honest: one epoch per --every steps, one full-test-set
eval batch per epoch, a backup (training_metadata.json naming that epoch) after each epoch;
the final val metrics are recomputed outside the clock. Then a fresh model runs `fit` again
on the same backup_dir: BackupAndRestore must restore it at the last epoch, so it runs 0
epochs (`resumed_epochs_run`) and evaluates as the trained one did.
Human-readable lines go to stderr; the last stdout line is one JSON object.

    uv run --group bench python benchmarks/keras_peer.py [--steps 2000] [--every 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

BATCH, EVAL_BATCH = 128, 360


def log(msg: str) -> None:
    print(f"[keras_peer] {msg}", file=sys.stderr, flush=True)


def run_keras(steps: int, every: int, workdir: str) -> dict:
    if steps % every:
        raise ValueError(
            f"--steps ({steps}) must be a multiple of --every ({every}): one epoch is --every steps"
        )
    t_import = time.perf_counter()
    os.environ["KERAS_BACKEND"] = "jax"  # before keras is imported
    import jax
    import keras
    import numpy as np

    from prefect_jax.examples.digits import load_digits_split

    if keras.backend.backend() != "jax":
        raise RuntimeError(f"keras was already imported with backend {keras.backend.backend()!r}")
    jax.devices()

    class Probe(keras.callbacks.Callback):
        """Times batch 0 and counts epochs, eval batches and backups
        (listed after BackupAndRestore)."""

        def __init__(self, backup_dir: str):
            super().__init__()
            self.backup_dir, self.t_first = backup_dir, None
            self.epochs = self.evals = self.test_batches = self.backups = 0

        def on_train_batch_end(self, batch, logs=None):
            if self.t_first is None:
                self.t_first = time.perf_counter()

        def on_test_begin(self, logs=None):
            self.evals += 1

        def on_test_batch_end(self, batch, logs=None):
            self.test_batches += 1

        def on_epoch_end(self, epoch, logs=None):
            self.epochs += 1
            with open(os.path.join(self.backup_dir, "training_metadata.json")) as f:
                self.backups += json.load(f)["epoch"] == epoch + 1
            log(
                f"keras epoch {epoch + 1} (step {(epoch + 1) * every}): "
                f"train loss {logs['loss']:.4f}, "
                f"val loss {logs['val_loss']:.4f}, val accuracy {logs['val_accuracy']:.4f}"
            )

    def new_model():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(10),
            ]
        )  # built by the Input, as BackupAndRestore requires
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    backup_dir = os.path.join(workdir, "backup")
    epochs = steps // every

    def fit(model, x, y, x_test, y_test):
        probe = Probe(backup_dir)
        backup = keras.callbacks.BackupAndRestore(
            backup_dir=backup_dir, save_freq="epoch", delete_checkpoint=False
        )
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=epochs,
            shuffle=False,
            validation_data=(x_test, y_test),
            validation_batch_size=EVAL_BATCH,
            callbacks=[backup, probe],
            verbose=0,
        )
        return history, probe

    t0 = time.perf_counter()
    x_train, y_train, x_test, y_test = load_digits_split()
    rng = np.random.default_rng(0)
    n = every * BATCH
    idx = np.concatenate([rng.permutation(len(x_train)) for _ in range(-(-n // len(x_train)))])[:n]
    x, y = x_train[idx], y_train[idx]
    model = new_model()
    history, probe = fit(model, x, y, x_test, y_test)
    t_end = time.perf_counter()

    # Honesty checks, off the clock.
    assert probe.epochs == epochs and probe.backups == epochs, vars(probe)
    assert probe.evals == epochs and probe.test_batches == epochs * -(-len(x_test) // EVAL_BATCH), (
        vars(probe)
    )
    assert int(model.optimizer.iterations) == steps, int(model.optimizer.iterations)
    final = {
        "loss": history.history["val_loss"][-1],
        "accuracy": history.history["val_accuracy"][-1],
    }
    logits = np.asarray(model(x_test), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    recomputed = {
        "loss": float(-logp[np.arange(len(y_test)), y_test].mean()),
        "accuracy": float((logits.argmax(-1) == y_test).mean()),
    }
    assert all(abs(final[k] - recomputed[k]) < 1e-4 for k in final), (final, recomputed)

    log("resume check: a fresh model, fit again on the same backup_dir ...")
    resumed = new_model()
    _, resumed_probe = fit(resumed, x, y, x_test, y_test)
    resumed_eval = resumed.evaluate(
        x_test, y_test, batch_size=EVAL_BATCH, verbose=0, return_dict=True
    )
    assert all(abs(resumed_eval[k] - final[k]) < 1e-4 for k in final), (resumed_eval, final)
    assert int(resumed.optimizer.iterations) == steps, int(resumed.optimizer.iterations)

    return {
        "wall_s": t_end - t0,
        "loop_s": t_end - probe.t_first,
        "import_s": t0 - t_import,
        "eval": final,
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "jax": jax.__version__,
        "devices": str(jax.devices()),
        "jit_compile": model.jit_compile,
        "steps_per_execution": model.steps_per_execution,
        "epochs_run": probe.epochs,
        "evals_run": probe.evals,
        "backups_seen": probe.backups,
        "resumed_epochs_run": resumed_probe.epochs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    parser.add_argument(
        "--every", type=int, default=200, help="backup + full eval every N steps (default 200)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-keras-") as workdir:
        result = run_keras(args.steps, args.every, workdir)
    log(
        f"keras: wall {result['wall_s']:.2f}s (steps 2..{args.steps}: {result['loop_s']:.2f}s; "
        f"imports {result['import_s']:.2f}s, not counted), eval {result['eval']}, "
        f"resumed fit ran {result['resumed_epochs_run']} epochs"
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
