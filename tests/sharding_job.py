"""Sharded runs of the tiny byte LM on CPU devices, in a process of their own (the device count is
fixed before jax imports): ``python sharding_job.py MODE DEVICES [ARGS...]``; prints JSON lines.

Modes:
    loss: the same steps with and without declared shardings, through `Loop` (no storage).
    bad: each bad mesh, spec and batch, refused by `Loop(...)` before any compute; then a Flax
        NNX model with sharding annotations, built and trained as it is.
    job STORAGE MLFLOW_URI MAX_STEPS PACE: a real job (`Trainer`, Orbax checkpoints, MLflow);
        one line per checkpoint with the live state's fingerprint, PACE seconds of sleep at each
        log point (so a test can SIGKILL it mid-job). Its mesh: MESH_ENV's JSON.
    evaluate STORAGE MLFLOW_URI MAX_STEPS: that job's newest step evaluated by an evaluator's
        `Trainer` (`recover`, `evaluate_if_new`), as the `evaluate` role does, then a trainer's
        `restore_or_init` on the same devices; one line.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={int(sys.argv[2])}"

import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

from annotated_program import Annotated  # noqa: E402

from prefect_jax.examples.bytelm import PRESETS, ByteLMProgram  # noqa: E402

MESH_ENV = "SHARDING_JOB_MESH"
DEVICE_COPY_ENV = "SHARDING_JOB_DEVICE_COPY"  # "1": `CheckpointSpec(device_copy=True)`


def tiny(**overrides) -> ByteLMProgram:
    return ByteLMProgram(dataclasses.replace(PRESETS["tiny"], **overrides))


class Undeclared(ByteLMProgram):
    """The byte LM without a mesh or shardings: the engine's default placement."""

    mesh_axes = None
    shardings = None


# The job's program (`sharding_job:program`): its mesh from the environment.
program = tiny(mesh=json.loads(os.environ.get(MESH_ENV) or "null"))


def specs(state) -> dict:
    """The spec of a few leaves of a (byte LM) state."""
    params, mu = state["params"], state["opt"][1][0].mu
    return {
        "embed": str(params["embed"]["embedding"].sharding.spec),
        "head": str(params["head"]["kernel"].sharding.spec),
        "qkv": str(params["blocks"][0]["qkv"]["kernel"].sharding.spec),
        "head_mu": str(mu["head"]["kernel"].sharding.spec),
    }


def losses(prog, steps: int = 6, per_dispatch: int = 1, evaluate: bool = True) -> dict:
    from prefect_jax.training.loop import Loop
    from prefect_jax.training.specs import TrainSpec
    from prefect_jax.training.train_means import train_rows

    traces = []  # the program's train step, each time its body runs (a trace)
    train_step = prog.train_step

    def counted(state, batch):
        traces.append(1)
        return train_step(state, batch)

    prog.train_step = counted
    loop = Loop(prog, TrainSpec(max_steps=steps, steps_per_dispatch=per_dispatch))
    state = loop.place(loop.init_state())
    loop.start_precompile()  # as a restore does (where the loop compiles ahead)
    interval = loop.run(state, 0, loop.fresh_iter(), target=steps, stop=lambda: False)
    rows = train_rows(interval.logged)
    out = {"loss": [v for k, v, _ in rows if k == "loss"], "traced": len(traces)}
    if evaluate:
        import jax

        placed, jitted = [], loop.eval_step  # how each eval batch reaches the eval step

        def eval_step(state, batch):
            leaf = jax.tree.leaves(batch)[0]
            placed.append(str(leaf.sharding.spec) if isinstance(leaf, jax.Array) else "host")
            return jitted(state, batch)

        loop.eval_step = eval_step
        out["eval"] = loop.evaluate(interval.state, 2)[0]["loss"]
        out["eval_batches"] = placed
    if loop.sharded:
        out["specs"] = specs(interval.state)
    return out


def loss_mode() -> None:
    mixed = dict(grad_accum=2, compute_dtype="bfloat16")
    runs = {
        "one_device": losses(Undeclared(PRESETS["tiny"])),
        "fsdp8": losses(tiny()),
        "mixed_one_device": losses(
            Undeclared(dataclasses.replace(PRESETS["tiny"], **mixed)), 6, 3, evaluate=False
        ),
        "mixed_4x2": losses(tiny(mesh={"data": 4, "model": 2}, **mixed), 6, 3, evaluate=False),
    }
    gathers = token_gathers(tiny(grad_accum=2, mesh={"data": 8}))
    print(json.dumps({"runs": runs, "token_gathers": gathers}), flush=True)


def token_gathers(prog) -> list[str]:
    """The all-gathers of integer arrays (the token batch) in the compiled sharded train step:
    each micro-batch of gradient accumulation should be spread over the data axis as the batch
    is, and need none."""
    import re

    import jax

    from prefect_jax.training.loop import Loop
    from prefect_jax.training.specs import TrainSpec

    loop = Loop(prog, TrainSpec(max_steps=1))
    batch = jax.eval_shape(lambda: prog.train_data(0)[0])
    step = jax.jit(prog.train_step, in_shardings=(loop.state_sharding, loop.batch_sharding))
    hlo = step.lower(loop.abstract_state, batch).compile().as_text()
    gathered = re.findall(r"= ([a-z0-9]+\[[0-9,]*\])\S* all-gather(?:-start)?\(", hlo)
    return [shape for shape in gathered if not shape.startswith(("f", "bf"))]


def annotated() -> dict:
    from prefect_jax.training.loop import Loop
    from prefect_jax.training.specs import TrainSpec

    loop = Loop(Annotated(), TrainSpec(max_steps=3))
    state = loop.place(loop.init_state())
    interval = loop.run(state, 0, loop.fresh_iter(), target=3, stop=lambda: False)
    kernel = interval.state["kernel"][...]
    return {
        "kernel": str(kernel.sharding.spec),
        "loss": loop.evaluate(interval.state, 2)[0]["loss"],
    }


def bad_mode() -> None:
    from jax.sharding import PartitionSpec as P

    from prefect_jax.training.loop import Loop
    from prefect_jax.training.sharded_state import check_sharding, check_train_batch
    from prefect_jax.training.specs import TrainSpec

    class Spec(ByteLMProgram):
        def __init__(self, specs, **overrides):
            super().__init__(dataclasses.replace(PRESETS["tiny"], **overrides))
            self._specs = specs

        def shardings(self, abstract_state, mesh):
            return self._specs(abstract_state)

    import jax

    def head_only(spec):
        def specs(state):
            out = jax.tree.map(lambda _: None, state)
            out["params"]["head"]["kernel"] = spec
            return out

        return specs

    cases = {
        "mesh": tiny(mesh={"data": 3}),
        "mesh_rest": tiny(mesh={"data": -1, "model": 3}),
        "axis": Spec(head_only(P(None, "model"))),
        # the head kernel is (12, 256): 12 rows do not split 8 ways
        "not_divisible": Spec(head_only(P("data")), d_model=12, n_heads=2),
        "batch": tiny(batch_size=4),
    }
    refused = {}
    for name, prog in cases.items():
        try:
            check_train_batch(Loop(prog, TrainSpec(max_steps=1)))  # (as a trainer's restore)
            refused[name] = None
        except ValueError as exc:
            refused[name] = f"{type(exc).__name__}: {exc}"
    # The command's checks of an evaluator (it never takes a train batch): the batch passes.
    check_sharding(cases["batch"], trains=False)
    out = {"refused": refused, "annotated": annotated(), "idle": idle_axis_warnings()}
    print(json.dumps(out), flush=True)


def idle_axis_warnings() -> dict:
    """The warnings logged as `Loop`s are made on a 4 x 2 mesh whose second axis the program's
    shardings and batches use or not (its 2 devices then repeat the same work)."""
    import logging

    from prefect_jax.training.loop import Loop
    from prefect_jax.training.specs import TrainSpec

    class Spare(ByteLMProgram):
        mesh_axes = {"data": 4, "spare": 2}  # FSDP over data; nothing names "spare"

    class Used(ByteLMProgram):
        mesh_axes = {"data": 4, "model": 2}  # the LM splits its matmuls over "model"

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("prefect_jax.trainer")
    logger.addHandler(handler)
    out = {}
    for name, cls in (("spare", Spare), ("used", Used)):
        said.clear()
        Loop(cls(PRESETS["tiny"]), TrainSpec(max_steps=1))
        out[name] = [m for m in said if "splits neither" in m]
    logger.removeHandler(handler)
    return out


def job_config(storage: str, mlflow_uri: str, max_steps: str):
    from prefect_jax.training.specs import CheckpointSpec, EvalSpec, JobConfig, TrainSpec

    return JobConfig(
        program="sharding_job:program",
        job="sharded",
        storage=storage,
        train=TrainSpec(max_steps=int(max_steps), log_every_steps=5),
        checkpoint=CheckpointSpec(
            every_steps=10, keep_last=None, device_copy=os.environ.get(DEVICE_COPY_ENV) == "1"
        ),
        eval=EvalSpec(steps=1),
        mlflow_tracking_uri=mlflow_uri,
    )


def job_mode(storage: str, mlflow_uri: str, max_steps: str, pace: str) -> None:
    from prefect_jax.training.progress import add_progress_listener
    from prefect_jax.training.trainer import Trainer
    from prefect_jax.training.trees import state_fingerprint

    config = job_config(storage, mlflow_uri, max_steps)
    if float(pace):
        add_progress_listener(lambda *_: time.sleep(float(pace)))
    trainer = Trainer(config)
    start = trainer.restore_or_init()
    first = {"start": start, "fp": state_fingerprint(trainer.state), "specs": specs(trainer.state)}
    print(json.dumps(first), flush=True)
    while trainer.step < int(max_steps):
        step = trainer.train_until_checkpoint()
        print(json.dumps({"step": step, "fp": state_fingerprint(trainer.state)}), flush=True)
    print(json.dumps({"end": trainer.step, "specs": specs(trainer.state)}), flush=True)
    trainer.finish()
    trainer.close()


def evaluate_mode(storage: str, mlflow_uri: str, max_steps: str) -> None:
    from prefect_jax.training.sharding import ShardingError
    from prefect_jax.training.trainer import Trainer

    config = job_config(storage, mlflow_uri, max_steps)
    trainer = Trainer(config)
    restored, step = trainer.recover()
    result = trainer.evaluate_if_new()
    trainer.close()
    out = {"step": step, "status": result.status.value, "metrics": result.metrics}
    trainer = Trainer(config)
    try:  # a trainer on these devices: its batch checked before its restore
        trainer.restore_or_init()
    except ShardingError as exc:
        out["train_refused"] = str(exc)
    trainer.close()
    print(json.dumps(out))


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[3:]
    modes = {"loss": loss_mode, "bad": bad_mode, "job": job_mode, "evaluate": evaluate_mode}
    modes[mode](*args)
