"""Test programs: the tiny digits program with injected failures."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from prefect_jax.examples.digits import DigitsProgram


class FailingDigits(DigitsProgram):
    """Tiny digits whose input pipeline raises `error` when batch number `fail_at` is produced.

    Batch i is consumed by step i + 1. `failures` is how many times it raises before it
    behaves (None: every time).
    """

    def __init__(
        self, fail_at: int, error: type[BaseException] = OSError, failures: int | None = 1
    ):
        super().__init__(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)
        self.fail_at, self.error, self.failures_left = fail_at, error, failures
        self._lock = threading.Lock()

    def train_data(self, seed: int):
        def check(index, batch):
            if index == self.fail_at:
                with self._lock:
                    if self.failures_left is None or self.failures_left > 0:
                        if self.failures_left is not None:
                            self.failures_left -= 1
                        raise self.error(f"injected failure producing batch {index}")
            return batch

        return super().train_data(seed).map_with_index(check)


def transient():
    """Fails once in the interval 20→40 with an OSError, then behaves."""
    return FailingDigits(fail_at=25)


def transient_twice():
    """Fails twice in the interval 20→40 with an OSError, then behaves."""
    return FailingDigits(fail_at=25, failures=2)


def permanent():
    """Fails before the first checkpoint, every time, with an error a retry cannot fix."""
    return FailingDigits(fail_at=5, error=TypeError, failures=None)


class TinyDigits(DigitsProgram):
    """The tiny digits program the broken ones below start from."""

    def __init__(self):
        super().__init__(hidden=(32, 32), learning_rate=3e-3, batch_size=32)


class FiniteDigits(TinyDigits):
    """Tiny digits whose training data ends after 25 batches (a dataset not repeated): a
    MapDataset, whose length is known before training, or an IterDataset, found as it ends."""

    def __init__(self, iterated: bool):
        super().__init__()
        self.iterated = iterated

    def train_data(self, seed: int):
        data = super().train_data(seed)[:25]
        return data.to_iter_dataset() if self.iterated else data


def finite():
    return FiniteDigits(iterated=True)


def finite_map():
    return FiniteDigits(iterated=False)


class EpochBatches(TinyDigits):
    """Keras's order: each epoch's examples batched, then repeated, its last batch short (the
    first 100 examples in batches of 32: the 4th batch holds 4)."""

    def train_data(self, seed: int):
        import grain

        from prefect_jax.examples.digits import load_digits_split

        x, y, _, _ = load_digits_split()
        records = [{"x": a, "y": b} for a, b in zip(x[:100], y[:100], strict=True)]
        return grain.MapDataset.source(records).batch(32).repeat()


def epoch_batches():
    return EpochBatches()


DATA = {"fingerprint": "digits v1"}
"""What `DataOfRecord.data_fingerprint` answers (an exception: raised), set by the test."""


class DataOfRecord(TinyDigits):
    """Tiny digits that says what its data is (`data_fingerprint`), as the test sets it."""

    def data_fingerprint(self):
        if isinstance(DATA["fingerprint"], BaseException):
            raise DATA["fingerprint"]
        return DATA["fingerprint"]


def data_of_record():
    return DataOfRecord()


class EndlessEval(TinyDigits):
    """Tiny digits whose eval_data() is repeated without end (a train_data habit)."""

    def eval_data(self):
        return super().eval_data().repeat()


class EndlessThenBatched(TinyDigits):
    """`EndlessEval` repeated before it is batched, as TF's input_fn did: repeat().batch(B)."""

    def eval_data(self):
        import grain

        return grain.MapDataset.source(list(range(100))).repeat().batch(8)


def endless_eval():
    return EndlessEval()


class MeanEval(TinyDigits):
    """Tiny digits whose eval_step returns means, not (sum, count) pairs (a Keras habit)."""

    def eval_step(self, state, batch):
        return {
            name: total / count for name, (total, count) in super().eval_step(state, batch).items()
        }


def mean_eval():
    return MeanEval()


class MeanEvalNamed(MeanEval):
    """`MeanEval` that declares its metric names: nothing traces its eval_step before training."""

    eval_metric_names = ("accuracy", "loss")


def mean_eval_named():
    return MeanEvalNamed()


class ExtraLeaf(TinyDigits):
    """Tiny digits whose train_step adds a leaf to the state init made."""

    def train_step(self, state, batch):
        import jax.numpy as jnp

        state, metrics = super().train_step(state, batch)
        return {**state, "lr": jnp.float32(3e-3)}, metrics


class StateOnly(TinyDigits):
    """Tiny digits whose train_step returns the state alone (no metrics)."""

    def train_step(self, state, batch):
        return super().train_step(state, batch)[0]


class PerExampleLoss(TinyDigits):
    """Tiny digits whose train_step returns a loss per example, not its mean."""

    def train_step(self, state, batch):
        import jax.numpy as jnp

        state, metrics = super().train_step(state, batch)
        return state, {**metrics, "loss": jnp.full(len(batch["y"]), metrics["loss"])}


class MixedTrainData(TinyDigits):
    """Tiny digits whose train_data became a mix of two (its position has other keys)."""

    def train_data(self, seed: int):
        import grain

        data = super().train_data(seed)
        return grain.IterDataset.mix([data.to_iter_dataset(), data.to_iter_dataset()], [0.5, 0.5])


class DeviceOutOfMemory(RuntimeError):
    """As XLA says a device ran out of memory (its XlaRuntimeError is a RuntimeError)."""

    def __init__(self, where: str):
        super().__init__(
            f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.13GiB ({where})"
        )


def out_of_memory():
    """Runs out of device memory once in the interval 20→40: a retry would get past it, so a
    test can tell that none was made."""
    return FailingDigits(fail_at=25, error=DeviceOutOfMemory)


class NaNDigits(DigitsProgram):
    """Tiny digits whose loss becomes NaN from step `nan_at` on (as if training diverged)."""

    def __init__(self, nan_at: int):
        super().__init__(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)
        self.nan_at = nan_at

    def train_step(self, state, batch):
        import jax.numpy as jnp

        new_state, metrics = super().train_step(state, batch)
        step = new_state["opt"][0].count  # Adam's step counter: the global step after this update
        metrics["loss"] = jnp.where(step >= self.nan_at, jnp.nan, metrics["loss"])
        return new_state, metrics


def diverges_at_33():
    return NaNDigits(nan_at=33)


class Paced:
    """Batches at most one per `step_secs` (one pipeline thread): an interval lasts long enough
    for a signal sent "mid-interval" to land there (the digits pipeline alone makes a step take
    well under a millisecond). ``PREFECT_JAX_TEST_STEP_SECS`` sets another pace (the state
    trained is the same). While the file named by ``PREFECT_JAX_TEST_HOLD`` exists, no batch
    comes: a test holds the training there while another process starts (its lease beats on)."""

    step_secs = 0.01

    def train_data(self, seed: int):
        import os
        import time

        import grain

        hold = os.environ.get("PREFECT_JAX_TEST_HOLD")
        step_secs = float(os.environ.get("PREFECT_JAX_TEST_STEP_SECS", self.step_secs))

        def paced(batch):
            time.sleep(step_secs)
            while hold and os.path.exists(hold):
                time.sleep(0.05)
            return batch

        options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=1)
        return super().train_data(seed).map(paced).to_iter_dataset(options)


class BigDigits(Paced, DigitsProgram):
    """Tiny digits carrying 24 MiB of random (incompressible) ballast in its state, so that a
    checkpoint takes long enough to write that a test can kill the process in the middle of it.

    Its batches are paced (`Paced`).
    """

    def init(self, rng):
        import jax

        ballast = jax.random.uniform(jax.random.fold_in(rng, 1), (6 * 1024 * 1024,))
        return {**super().init(rng), "ballast": ballast}

    def train_step(self, state, batch):
        rest = {k: v for k, v in state.items() if k != "ballast"}
        new_state, metrics = super().train_step(rest, batch)
        return {**new_state, "ballast": state["ballast"]}, metrics


def big():
    return BigDigits(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)


class PacedDigits(Paced, DigitsProgram):
    """Tiny digits with paced batches (several JAX processes, `test_multiprocess`)."""


def paced():
    return PacedDigits(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)


class BadShardInProcess1(PacedDigits):
    """Paced digits whose input fails in process 1 of several at its 150th batch (a bad shard, a
    bug of that host's): that process fails on its own, and no other."""

    def train_data(self, seed: int):
        import jax

        data = super().train_data(seed)
        if jax.process_index() != 1:
            return data
        read = iter(range(1, 10**9))

        def check(batch):
            if next(read) == 150:
                raise ValueError("shard 7 of process 1 is unreadable")
            return batch

        return data.map(check)


def bad_shard_in_process_1():
    return BadShardInProcess1(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)


class GcWatchingDigits(DigitsProgram):
    """Tiny digits that note, at each evaluation, whether Python's garbage collector is on and how
    many objects are frozen (one JSON line each in the file ``PREFECT_JAX_TEST_GC_LOG`` names).
    Its metric names are declared, so the command's check of them reads no eval data at start-up."""

    eval_metric_names = ("accuracy", "loss")

    def eval_data(self):
        import gc
        import json
        import os

        with open(os.environ["PREFECT_JAX_TEST_GC_LOG"], "a") as f:
            f.write(json.dumps({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}) + "\n")
        return super().eval_data()


def gc_watching():
    return GcWatchingDigits(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)


class _MarksTeardown:
    """Writes ``PREFECT_JAX_TEST_TEARDOWN_MARK``'s file when the interpreter's teardown frees
    it (a module global: freed with its module)."""

    def __init__(self):
        self.path = os.environ.get("PREFECT_JAX_TEST_TEARDOWN_MARK")

    def __del__(self, _open=open):  # (bound now: the teardown clears the builtins first)
        if self.path:
            with _open(self.path, "w") as f:
                f.write("torn down")


_marks_teardown = None


class LeavesAThread(DigitsProgram):
    """Tiny digits that starts a thread of its own (not a daemon) that runs on for two minutes
    after the job is done: the command waits for it at its exit, as for a background compile or
    a copy of the compilation cache still under way. Its module marks the interpreter's teardown
    (`_MarksTeardown`), which a command's exit never runs."""

    def train_data(self, seed: int):
        global _marks_teardown
        if not any(t.name == "leaves-a-thread" for t in threading.enumerate()):
            _marks_teardown = _MarksTeardown()
            threading.Thread(target=time.sleep, args=(120,), name="leaves-a-thread").start()
        return super().train_data(seed)


def leaves_a_thread():
    return LeavesAThread(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)


class SomePlatformsServe(DigitsProgram):
    """serve() holds an op that lowers on this machine's platform and one more (`SOME_PLATFORMS`)
    alone, as a Pallas kernel lowers on GPUs alone."""

    def serve(self, state, inputs):
        return _some_platforms_identity().bind(super().serve(state, inputs))


def some_platforms() -> tuple[str, str]:
    import jax

    here = jax.export.default_export_platform()
    return here, "cuda" if here != "cuda" else "cpu"


def _some_platforms_identity():
    global _SOME
    if _SOME is None:
        from jax.extend.core import Primitive
        from jax.interpreters import mlir

        _SOME = Primitive("some_platforms_identity")
        _SOME.def_impl(lambda x: x)
        _SOME.def_abstract_eval(lambda x: x)
        for platform in some_platforms():
            mlir.register_lowering(_SOME, lambda ctx, x: [x], platform=platform)
    return _SOME


_SOME = None


def some_platforms_serve():
    return SomePlatformsServe(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)


def higher_accuracy(best_eval_result: dict, current_eval_result: dict) -> bool:
    """A `BestExporter.compare_fn` in TF's signature: the current result is better when its
    accuracy is higher (whatever its loss)."""
    return current_eval_result["accuracy"] > best_eval_result["accuracy"]


def higher_accuracy_positional(best_eval_result: dict, current_eval_result: dict, /) -> bool:
    """`higher_accuracy` whose parameters cannot be given by name: called by position."""
    return current_eval_result["accuracy"] > best_eval_result["accuracy"]


def higher_accuracy_current_first(current_eval_result: dict, best_eval_result: dict) -> bool:
    """`higher_accuracy` with TF's parameters the other way round: TF calls them by name."""
    return current_eval_result["accuracy"] > best_eval_result["accuracy"]


class StopAfterTwo:
    """An eval listener in TF's `_ContinuousEvalListener` shape, as a TF user wrote it:
    `before_eval` takes no argument, `after_eval(eval_result)` answers False to end the
    continuous evaluation after two evaluations. `seen` records the steps of every instance, and
    `paths` their results' `checkpoint_path` (TF's `_EvalResult` field)."""

    seen: list[int] = []
    paths: list[str] = []

    def __init__(self):
        self.evaluations = 0

    def before_eval(self):
        return True

    def after_eval(self, eval_result):
        StopAfterTwo.seen.append(eval_result.metrics["global_step"])  # (as TF's eval dicts)
        StopAfterTwo.paths.append(eval_result.checkpoint_path)
        self.evaluations += 1
        return self.evaluations < 2


class RaisingListener:
    """An eval listener whose after_eval raises (a bug in it, or a metric it expects missing)."""

    def after_eval(self, eval_result):
        raise KeyError("checkpoint_step")


class TwoArgumentListener:
    """A before_eval no evaluator can call (two arguments)."""

    def before_eval(self, step, other):
        return True


class DigitsParams(BaseModel):
    """Typed params of `typed_digits` (a pydantic model): `max_steps` is the engine's to fill,
    `read_threads` changes nothing computed (exempt from the restore check)."""

    model_config = ConfigDict(extra="forbid")
    restore_exempt: ClassVar[tuple[str, ...]] = ("read_threads",)

    learning_rate: float = 3e-3
    width: int = 32
    max_steps: int | None = None
    read_threads: int = 0


def typed_digits(params: DigitsParams) -> DigitsProgram:
    """The tiny digits program built from typed params; it keeps them to be looked at."""
    program = DigitsProgram(
        hidden=(params.width, params.width),
        learning_rate=params.learning_rate,
        batch_size=32,
        dropout=0.1,
    )
    program.params = params
    return program


@dataclasses.dataclass
class WidthParams:
    """Typed params as a dataclass."""

    width: int = 32
    dropout: float = 0.1


def dataclass_digits(params: WidthParams) -> DigitsProgram:
    program = DigitsProgram(
        hidden=(params.width, params.width), batch_size=32, dropout=params.dropout
    )
    program.params = params
    return program


class DigitsWithPerplexity(DigitsProgram):
    """Tiny digits that derives ``perplexity`` (exp of the mean eval loss) and declares
    ``tokens_per_step`` (its batch size, as if an example were a token)."""

    tokens_per_step = 32

    def __init__(self):
        super().__init__(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)

    def derive_metrics(self, means):
        import math

        return {"perplexity": math.exp(means["loss"])}


def clashing_derived():
    """A derive_metrics that returns a name eval_step already aggregates."""
    program = DigitsWithPerplexity()
    program.derive_metrics = lambda means: {"loss": 0.0}
    return program


class NamedInputsDigits(DigitsProgram):
    """serve() takes two named inputs: the images, and a temperature per row (its own symbolic
    batch: both dims from one `symbolic_shape` call)."""

    def serving_input(self):
        import jax
        import jax.numpy as jnp

        (b,) = jax.export.symbolic_shape("b")
        return {
            "pixels": jax.ShapeDtypeStruct((b, 64), jnp.float32),
            "temperature": jax.ShapeDtypeStruct((b,), jnp.float32),
        }

    def serve(self, state, inputs):
        import jax

        logits = self.apply(state["params"], inputs["pixels"])
        return jax.nn.softmax(logits / inputs["temperature"][:, None], axis=-1)

    def serving_example(self):
        import numpy as np

        from prefect_jax.examples.digits import load_digits_split

        pixels = load_digits_split()[2][:4]
        return {"pixels": pixels, "temperature": np.linspace(0.5, 2.0, 4, dtype=np.float32)}


def named_inputs():
    return NamedInputsDigits(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)


class IntOnSymbolicDim(DigitsProgram):
    """serve() takes int() of the symbolic batch: it cannot be exported (the wall of issue 52)."""

    def serve(self, state, x):
        import jax.numpy as jnp

        return super().serve(state, x) + jnp.zeros((int(x.shape[0]), 10))


def int_on_symbolic_dim():
    return IntOnSymbolicDim(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)


class FailsAtExport(DigitsProgram):
    """serve() traces on the abstract state (the check before training passes) but raises on the
    trained values, as a serve with a host-side check of its weights would: the export fails."""

    def serve(self, state, x):
        import jax
        import numpy as np

        if any(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(state)):
            raise RuntimeError("serve() refuses these weights")
        return super().serve(state, x)


def fails_at_export():
    return FailsAtExport(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)


class FailsOnceAtExport(DigitsProgram):
    """serve() refuses the trained values the first time only, as a storage error of a moment
    would fail one export: the export tried once more succeeds."""

    refused = 0

    def serve(self, state, x):
        import jax
        import numpy as np

        if any(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(state)):
            if not FailsOnceAtExport.refused:
                FailsOnceAtExport.refused += 1
                raise RuntimeError("serve() refuses these weights, once")
        return super().serve(state, x)


def fails_once_at_export():
    FailsOnceAtExport.refused = 0
    return FailsOnceAtExport(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)


class SlowExport(DigitsProgram):
    """serve() takes a while to trace on the trained values (at an export, not in the check before
    training), as a large model's lowering does: longer than a tiny interval's training."""

    def serve(self, state, x):
        import time

        import jax
        import numpy as np

        if any(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(state)):
            time.sleep(2.0)
        return super().serve(state, x)


def slow_export():
    return SlowExport(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)


def stop_at_25(view) -> None:
    """A train hook that stops the job at step 25, as TF's StopAtStepHook(last_step=25) would."""
    if view.step == 25:
        view.request_stop("step 25 reached")


def record_train_hook(view) -> None:
    """A train hook (TF's `TrainSpec.hooks`): one JSON line per call to the file named by
    ``PREFECT_JAX_TEST_HOOK_FILE``: the event, the step, the metric names, and a leaf of the
    state it was shown read to the host (reading is all a hook may do)."""
    import json
    import os

    import jax

    leaves = jax.tree_util.tree_leaves(view.state)
    leaf = next(x for x in leaves if getattr(x, "dtype", None) == "float32")
    line = {
        "event": view.event,
        "step": view.step,
        "max_steps": view.max_steps,
        "metrics": sorted(view.metrics),
        "job": view.job,
        "process": view.process_index,
        "leaf_sum": float(jax.device_get(leaf).sum()),
    }
    with open(os.environ["PREFECT_JAX_TEST_HOOK_FILE"], "a") as f:
        f.write(json.dumps(line) + "\n")


class StopJobAtEnvStep:
    """An eval hook that asks the whole job to stop (`should_stop_job`) once a step at or past
    ``PREFECT_JAX_TEST_STOP_AT`` is evaluated: how a job with ``max_steps=None`` ends."""

    def should_stop_job(self, result) -> bool:
        import os

        return result.step >= int(os.environ["PREFECT_JAX_TEST_STOP_AT"])


class DeviceBound(DigitsProgram):
    """Tiny digits whose step also runs `work` matmuls of a 384x384 matrix (tens of ms on a CPU)
    while its batches come at once: the device sets the pace, as a real model's step does (`Paced`
    paces the host instead, whose clock then tracks the steps done by itself)."""

    work = 96

    def train_step(self, state, batch):
        import jax
        import jax.numpy as jnp

        new_state, metrics = super().train_step(state, batch)
        seed = jnp.full((384, 384), 1e-3, jnp.float32) * batch["x"].mean()  # (no constant to fold)
        burnt = jax.lax.fori_loop(0, self.work, lambda _, m: jnp.tanh(m @ m), seed)
        return new_state, {**metrics, "work": burnt[0, 0]}


def device_bound():
    return DeviceBound(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)


class CountsLoadsAndTraces(DigitsProgram):
    """Tiny digits that writes a line to the file named by ``PREFECT_JAX_TEST_EVENTS`` each time
    it is made (``load``) and each time its train step is traced (``trace <thread>``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._note("load")

    @staticmethod
    def _note(event: str) -> None:
        with open(os.environ["PREFECT_JAX_TEST_EVENTS"], "a") as f:
            f.write(event + "\n")

    def train_step(self, state, batch):
        self._note(f"trace {threading.current_thread().name}")
        return super().train_step(state, batch)


def counts_loads_and_traces(params: DigitsParams) -> CountsLoadsAndTraces:
    """`CountsLoadsAndTraces` built from typed params (a new program per load)."""
    return CountsLoadsAndTraces(
        hidden=(params.width, params.width),
        learning_rate=params.learning_rate,
        batch_size=32,
        dropout=0.1,
    )
