"""Digits: a Flax NNX MLP trained with optax on scikit-learn's digits through a Grain pipeline.

The data ships with scikit-learn (1797 8x8 images), so nothing is downloaded. The train
state is ``{"params", "opt", "rng"}``: model parameters as a plain dict, the optax state,
and the dropout key, so a checkpoint holds every stream an exact resume needs.

Use it as ``prefect_jax.examples.digits:program``, or build a variant:

    ```python
    from prefect_jax.examples.digits import DigitsProgram
    program = DigitsProgram(hidden=(64, 64), learning_rate=3e-3)
    ```
"""

from __future__ import annotations

import functools
import importlib.util
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


class MLP(nnx.Module):
    """64 -> hidden[0] -> hidden[1] -> 10, ReLU, dropout after each hidden layer."""

    def __init__(self, din: int, hidden: tuple[int, int], dout: int, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(din, hidden[0], rngs=rngs)
        self.l2 = nnx.Linear(hidden[0], hidden[1], rngs=rngs)
        self.l3 = nnx.Linear(hidden[1], dout, rngs=rngs)

    def __call__(self, x, dropout_rate: float = 0.0, rng=None):
        for layer in (self.l1, self.l2):
            x = jax.nn.relu(layer(x))
            if rng is not None and dropout_rate > 0:
                rng, sub = jax.random.split(rng)
                keep = jax.random.bernoulli(sub, 1.0 - dropout_rate, x.shape)
                x = jnp.where(keep, x / (1.0 - dropout_rate), 0.0)
        return self.l3(x)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (data (1797, 64) in 0..16, target): read from the CSV file that
    scikit-learn ships, without importing scikit-learn (a slow import on a restart); the same arrays
    as ``sklearn.datasets.load_digits()``, which is the fallback if the file moved."""
    spec = importlib.util.find_spec("sklearn")  # locates the package without running it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(int)
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.data, data.target


@functools.lru_cache(maxsize=4)
def load_digits_split(test_fraction: float = 0.2, split_seed: int = 0):
    """Digits as float32 in [0, 1], split once with a fixed permutation: (x_train, y_train,
    x_test, y_test)."""
    data, target = digits_arrays()
    x = (data / 16.0).astype(np.float32)
    y = target.astype(np.int32)
    perm = np.random.default_rng(split_seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


class _Slices(grain.sources.RandomAccessDataSource if hasattr(grain, "sources") else object):
    """Eval batches: batch ``i`` is rows ``[i * size, (i + 1) * size)``, the last one shorter."""

    def __init__(self, x, y, size: int):
        self.x, self.y, self.size = x, y, size

    def __len__(self):
        return -(-len(self.x) // self.size)

    def __getitem__(self, i):
        rows = slice(int(i) * self.size, (int(i) + 1) * self.size)
        return {"x": self.x[rows], "y": self.y[rows]}


class _ShuffledBatches(
    grain.sources.RandomAccessDataSource if hasattr(grain, "sources") else object
):
    """Endless training batches: batch ``i`` is slice ``i % per_epoch`` of epoch
    ``i // per_epoch``'s permutation (seeded by (seed, epoch)), gathered with one numpy fancy
    index.

    Same reshuffle-each-epoch, drop-the-remainder semantics as Grain's per-record
    ``shuffle().repeat().batch()``, at a fraction of the Python cost per batch (that pipeline,
    not the model, was most of a step's time on this MLP). Random access by index, so Grain's
    iterator state (the next index) is all a checkpoint needs to resume the stream exactly.
    """

    def __init__(self, x, y, batch_size: int, seed: int):
        if len(x) < batch_size:
            raise ValueError(
                f"batch_size={batch_size} is larger than the {len(x)} training examples; lower it"
            )
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.per_epoch = len(x) // batch_size
        self._epoch, self._perm = -1, None

    def __len__(self):
        return 2**62  # endless: the index is the global batch number

    def _permutation(self, epoch: int):
        if epoch != self._epoch:
            self._perm = np.random.default_rng((self.seed, epoch)).permutation(len(self.x))
            self._epoch = epoch
        return self._perm

    def __getitem__(self, i):
        epoch, k = divmod(int(i), self.per_epoch)
        idx = self._permutation(epoch)[k * self.batch_size : (k + 1) * self.batch_size]
        return {"x": self.x[idx], "y": self.y[idx]}


class DigitsProgram:
    """The digits classifier as a prefect-jax program (see `prefect_jax.training.program`).

    Args:
        hidden: widths of the two hidden layers.
        learning_rate: Adam learning rate.
        batch_size: training batch size.
        eval_batch_size: eval batch size (the last batch may be smaller; metrics are exact).
        dropout: dropout rate on the hidden layers (0 disables it).
    """

    def __init__(
        self,
        hidden: tuple[int, int] = (256, 256),
        learning_rate: float = 1e-3,
        batch_size: int = 128,
        eval_batch_size: int = 360,
        dropout: float = 0.1,
    ):
        self.hidden = tuple(hidden)
        self.learning_rate = learning_rate
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.dropout = dropout
        self.tx = optax.adam(learning_rate)
        abstract = nnx.eval_shape(lambda: MLP(64, self.hidden, 10, rngs=nnx.Rngs(0)))
        self.graphdef, _ = nnx.split(abstract)

    read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    """How the trainer iterates `train_data`: in the training thread, without Grain's prefetch
    threads (each batch is one numpy gather; handing it over from a thread costs more)."""

    @property
    def config(self) -> dict:
        return {
            "model": "mlp",
            "hidden": list(self.hidden),
            "learning_rate": self.learning_rate,
            "batch_size": self.batch_size,
            "eval_batch_size": self.eval_batch_size,
            "dropout": self.dropout,
        }

    # -- the contract -------------------------------------------------------------------

    def init(self, rng):
        init_rng, dropout_rng = jax.random.split(rng)
        model = MLP(64, self.hidden, 10, rngs=nnx.Rngs(params=init_rng))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return {"params": params, "opt": self.tx.init(params), "rng": dropout_rng}

    def apply(self, params, x, rng=None):
        model = nnx.merge(self.graphdef, params)
        return model(x, self.dropout, rng)

    def train_step(self, state, batch):
        rng, step_rng = jax.random.split(state["rng"])

        def loss_fn(params):
            logits = self.apply(params, batch["x"], step_rng)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt = self.tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        accuracy = (logits.argmax(-1) == batch["y"]).mean()
        return {"params": params, "opt": opt, "rng": rng}, {"loss": loss, "accuracy": accuracy}

    def eval_step(self, state, batch):
        logits = self.apply(state["params"], batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        correct = (logits.argmax(-1) == batch["y"]).astype(jnp.float32)
        n = jnp.asarray(batch["y"].shape[0], jnp.float32)
        return {"loss": (losses.sum(), n), "accuracy": (correct.sum(), n)}

    def train_data(self, seed: int):
        x, y, _, _ = load_digits_split()
        return grain.MapDataset.source(_ShuffledBatches(x, y, self.batch_size, seed))

    def eval_data(self):
        _, _, x, y = load_digits_split()
        return grain.MapDataset.source(_Slices(x, y, self.eval_batch_size))

    # -- serving ------------------------------------------------------------------------

    def serving_input(self):
        return jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 64"), jnp.float32)

    def serve(self, state, x):
        """Class probabilities for a batch of flattened 8x8 images scaled to [0, 1]."""
        return jax.nn.softmax(self.apply(state["params"], x), axis=-1)


program = DigitsProgram()

tiny = DigitsProgram(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)
"""A smaller variant for fast tests."""
