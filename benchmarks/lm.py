"""The byte-level LM trained two ways in one run: prefect-jax's flow, and a bare JAX loop.

Both sides train the same program (`prefect_jax.examples.bytelm`, a preset) from the same seed
over the same Grain pipeline, save an asynchronous Orbax checkpoint (the state and the Grain
iterator) every --checkpoint-every steps and at the end, keep the newest 3, and evaluate every
saved step over the same eval batches. Sides, one after the other in this process:

- ``bare_nosave``: the bare loop without checkpoints (the floor for the checkpoint stall);
- ``bare``: a hand-written loop: ``jax.jit`` train step (state donated), Grain iterator, Orbax
  ``CheckpointManager`` async saves, eval by ``jax.jit`` eval step summed on the device;
- ``flow``: `prefect_jax.flows.train_and_evaluate` (an ephemeral Prefect server unless
  ``PREFECT_API_URL`` names one; MLflow on SQLite in the work folder).
- ``flow_nocopy``: the flow with ``CheckpointSpec(device_copy=False)``: each save given to Orbax
  on the training thread, as the bare loop does (``flow`` takes the default: on an accelerator,
  a copy of the state on the device given to Orbax on a thread, `save_handoff`).

Clocks: each side's loop time runs from the end of step --warmup (compiles done: the first
steps, and the eval step compiled before it, as the engine does ahead of its loop) to the last
checkpoint committed and the last evaluation read. tokens/s counts the tokens trained in that
window. The checkpoint stall is the loop time a side lost per save against ``bare_nosave``, as a
share of one synchronous save of the same state timed in the same run. Each side marks the time
every --warmup steps, the device synchronised (the flow through a progress listener), so the
JSON says where the loop time went: stretches without a save, what a stretch beginning at a save
takes beyond one (`per_save_boundary_s`), and the end after the last step (`end_s`). MFU is
``flops_per_token * tokens/s / peak`` (``ByteLMProgram.flops_per_token``: 6 per weight plus
attention's ``12 * layers * seq * d_model``); peak from --peak-tflops, or the device kind's dense
bf16 peak (H100, H200: 989 TFLOP/s); null on a CPU.

    uv run python benchmarks/lm.py --preset tiny --steps 60        # a couple of minutes on CPU
    python benchmarks/lm.py --preset gpu100m --steps 300 --checkpoint-every 100 --out lm.json

Prints one JSON line (and writes it to --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
import sys
import tempfile
import time

from lm_bare import bare, sync_save_s, timeline

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# A loaded machine starts the ephemeral server slower than Prefect's default wait.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}
"""Dense bf16 peaks by device kind (a substring of ``device_kind``)."""


def peak_flops(device_kind: str, given: float | None) -> float | None:
    if given:
        return given * 1e12
    for name, tflops in PEAK_TFLOPS.items():
        if name in device_kind:
            return tflops * 1e12
    return None


def flow(program_path: str, args, work: str, device_copy: bool | None = None) -> dict:
    import jax

    from prefect_jax.flows import train_and_evaluate
    from prefect_jax.training.progress import add_progress_listener
    from prefect_jax.training.specs import CheckpointSpec, EvalSpec, TrainSpec
    from prefect_jax.training.trainer_thread import THREAD_NAME as TRAINER_THREAD

    marks: list[tuple[int, float]] = []

    def at_log_point(step, max_steps, metrics):  # each --warmup steps: log points (`main`)
        # the loop's own call (the first at a step; the trainer's says so again once it saved)
        if step % args.warmup == 0 and step > (marks[-1][0] if marks else 0):
            jax.block_until_ready(metrics)
            marks.append((step, time.perf_counter()))

    remove = add_progress_listener(at_log_point)
    # What the checkpoints said (the hand-off taken or declined at the first save, with the
    # device memory figures; a copy that failed): run by run, whether saves were handed off.
    said, checkpoints_log = _Said(), logging.getLogger("prefect_jax.checkpoints")
    level = checkpoints_log.level
    checkpoints_log.setLevel(logging.INFO)
    checkpoints_log.addHandler(said)
    stacks = None
    try:
        if args.stacks:
            from stack_timeline import StackTimeline

            stacks = StackTimeline(TRAINER_THREAD).start()  # where the loop runs
        summary = train_and_evaluate(
            program=program_path,
            job="lm",
            storage=os.path.join(work, "flow" if device_copy is None else "flow_nocopy"),
            train_spec=TrainSpec(max_steps=args.steps, log_every_steps=args.warmup),
            checkpoint_spec=CheckpointSpec(
                every_steps=args.checkpoint_every, keep_last=3, device_copy=device_copy
            ),
            eval_spec=EvalSpec(),
            mlflow_tracking_uri=f"sqlite:///{work}/mlflow.db",
        )
        t_end = time.perf_counter()
    finally:
        remove()
        checkpoints_log.removeHandler(said)
        checkpoints_log.setLevel(level)
        if stacks is not None:
            stacks.stop()
            root, ext = os.path.splitext(args.stacks)  # (one file per flow side)
            with open(args.stacks if device_copy is None else f"{root}_nocopy{ext}", "w") as f:
                f.write(stacks.text())
    assert summary["final_step"] == args.steps, summary
    assert marks[0][0] == args.warmup, marks  # the window starts where the bare loop's does
    goodput = summary["goodput"]
    return {
        "loop_s": t_end - marks[0][1],
        "eval": summary["eval"],
        **timeline(marks, t_end),
        # the engine's own account of the whole job (start-up and compiles included)
        "goodput": {k: goodput[k] for k in ("wall_s", "productive_s", "lost_s") if k in goodput},
        "checkpoint_log": said.messages,
    }


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:500])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="tiny, small or gpu100m")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=None, help="default: --steps / 3")
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps before the clocks start (default: half an interval)",
    )
    parser.add_argument(
        "--config", default="{}", help="JSON overrides of the preset's Config fields"
    )
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument(
        "--sides",
        default="bare_nosave,bare,flow",
        help="which sides to run, in this order, of bare_nosave, bare, flow, flow_nocopy "
        "(a short GPU lease: flow,bare_nosave,bare)",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--stacks",
        default=None,
        help="write the flow side's training-thread stacks, sampled, to this file "
        "(benchmarks/stack_timeline.py: what a save's stretch and the end cost)",
    )
    args = parser.parse_args()
    order = args.sides.split(",")
    if not order or set(order) - {"bare_nosave", "bare", "flow", "flow_nocopy"}:
        parser.error(
            f"--sides {args.sides!r}: a comma-separated subset of bare_nosave,bare,flow,flow_nocopy"
        )
    args.checkpoint_every = args.checkpoint_every or max(1, args.steps // 3)
    args.warmup = args.warmup or max(1, args.checkpoint_every // 2)
    if args.checkpoint_every % args.warmup or args.steps % args.warmup:
        parser.error(
            f"--warmup {args.warmup} must divide --checkpoint-every {args.checkpoint_every} and "
            f"--steps {args.steps} (the marks fall on the saves and the last step)"
        )
    if args.warmup >= args.checkpoint_every:
        parser.error("--warmup must be below --checkpoint-every")

    import jax

    from prefect_jax.examples import bytelm

    if args.preset not in bytelm.PRESETS:
        parser.error(f"--preset {args.preset!r}: one of {sorted(bytelm.PRESETS)}")
    overrides = json.loads(args.config)
    program = bytelm.ByteLMProgram(dataclasses.replace(bytelm.PRESETS[args.preset], **overrides))
    bytelm.bench = program  # the flow loads it by path, in this process
    program_path = "prefect_jax.examples.bytelm:bench"
    step_fn = jax.jit(program.train_step, donate_argnums=(0,))
    eval_fn = jax.jit(program.eval_step)
    import prefect_jax.flows  # noqa: F401 - imported before every clock, for every side alike

    t = time.perf_counter()
    program.corpus()
    corpus_s = time.perf_counter() - t
    device = jax.devices()[0]
    cfg = program.cfg
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len
    window_tokens = (args.steps - args.warmup) * tokens_per_step
    out: dict = {
        "preset": args.preset,
        "params": program.param_count,
        "device_kind": device.device_kind,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "steps": args.steps,
        "checkpoint_every": args.checkpoint_every,
        "warmup": args.warmup,
        "overrides": overrides,
        "tokens_per_step": tokens_per_step,
        "compute_dtype": cfg.compute_dtype,
        "corpus_s": corpus_s,
    }
    work = tempfile.mkdtemp(prefix="lm-bench-")
    print(
        f"[lm] {args.preset}: {program.param_count:,} params on {device.device_kind}; work {work}",
        flush=True,
    )

    sides = {}
    out["sync_save_s"] = sync_save_s(program, os.path.join(work, "sync"))
    emit(out, args.out)
    print(f"[lm] synchronous save: {out['sync_save_s']:.3f} s", flush=True)
    bare_dir = os.path.join(work, "bare")
    runs = {
        "bare_nosave": lambda: bare(program, args, None, step_fn, eval_fn),
        "bare": lambda: bare(program, args, bare_dir, step_fn, eval_fn),
        "flow": lambda: flow(program_path, args, work),
        "flow_nocopy": lambda: flow(program_path, args, work, device_copy=False),
    }
    peak = peak_flops(device.device_kind, args.peak_tflops)
    out["peak_flops"] = peak
    for name in order:
        side = sides[name] = runs[name]()
        side["tokens_per_s"] = window_tokens / side["loop_s"]
        side["mfu"] = program.flops_per_token() * side["tokens_per_s"] / peak if peak else None
        emit(dict(out, sides=sides), args.out)  # what a run cut short still leaves
        print(
            f"[lm] {name}: loop {side['loop_s']:.2f} s, {side['tokens_per_s']:,.0f} tokens/s",
            flush=True,
        )
    for side in sides.values():
        side.update(boundaries(side["marks"], args.checkpoint_every))
    floor = sides.get("bare_nosave")
    for name, side in sides.items():
        if floor and name != "bare_nosave":
            saves = args.steps // args.checkpoint_every + (args.steps % args.checkpoint_every > 0)
            lost = (side["loop_s"] - floor["loop_s"]) / saves
            side["stall_per_save_s"] = lost
            side["stall_share_of_sync_save"] = lost / out["sync_save_s"]
    out["sides"] = sides
    if "flow" in sides and "bare" in sides:
        out["loop_ratio"] = sides["flow"]["loop_s"] / sides["bare"]["loop_s"]
        out["tokens_per_s_ratio"] = sides["flow"]["tokens_per_s"] / sides["bare"]["tokens_per_s"]
    if "flow_nocopy" in sides and "bare" in sides:
        out["tokens_per_s_ratio_nocopy"] = (
            sides["flow_nocopy"]["tokens_per_s"] / sides["bare"]["tokens_per_s"]
        )
    # Same seed, data and steps: every side ends with the same eval, up to float order (bf16
    # on a GPU: XLA's reductions are not bit-reproducible from run to run).
    stats = device.memory_stats() or {}  # (None on a CPU) the process's peak over every side
    out["device_memory"] = {k: stats[k] for k in ("peak_bytes_in_use", "bytes_limit") if k in stats}
    losses = [side["eval"]["loss"] for side in sides.values()]
    out["eval_loss_spread"] = (max(losses) - min(losses)) / min(losses)
    out["same_eval"] = out["eval_loss_spread"] < (5e-3 if cfg.compute_dtype != "float32" else 1e-4)
    print(emit(out, args.out), flush=True)


def boundaries(marks: list, every: int) -> dict:
    """From a side's marks: the mean seconds of a stretch of --warmup steps with no save in it,
    and what a stretch that starts at a save (its save, its eval and, in the flow, the interval's
    end and the next one's start) takes beyond that."""
    stretches = [(a, tb - ta) for (a, ta), (_, tb) in itertools.pairwise(marks)]
    plain = [s for a, s in stretches if a % every]
    at_save = [s for a, s in stretches if a % every == 0]
    out = {"stretch_s": sum(plain) / len(plain) if plain else None}
    if plain and at_save:
        out["per_save_boundary_s"] = sum(at_save) / len(at_save) - out["stretch_s"]
    return out


def emit(out: dict, path: str | None) -> str:
    line = json.dumps(out)
    if path:
        with open(path, "w") as f:
            f.write(line + "\n")
    return line


if __name__ == "__main__":
    main()
