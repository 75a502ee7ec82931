"""Train the tiny job two intervals in this (fresh) process and print, as one JSON line, how many
times the train step was compiled, how the persistent compilation cache answered for it, and how
many times the program's train step was traced (``traced``: its Python body run).

usage: python count_compiles.py STORAGE MLFLOW_URI [CACHE_DIR [OPTIONS_JSON [lost|slow-pull]]]

``OPTIONS_JSON``: the storage options, as JSON.

``lost``: the node is lost in the first interval. At the first log point (step 10, before any
checkpoint), once the train step's cache entry is in storage, the counts are printed and the
process SIGKILLs itself (after 60 s without the entry it prints ``{"timeout": ...}`` instead).
``slow-pull``: copying a remote cache in takes 3 s longer (a large cache, a slow store): the
trainer must wait for it before compiling its steps.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time


class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.counts = {"compiled": 0, "cache_miss": 0, "cache_hit": 0, "traced": 0}

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling jit(step)"):
            self.counts["compiled"] += 1
        elif "PERSISTENT COMPILATION CACHE MISS for 'jit_step'" in message:
            self.counts["cache_miss"] += 1
        elif "Persistent compilation cache hit for 'jit_step'" in message:
            self.counts["cache_hit"] += 1


def main(
    storage: str,
    mlflow_uri: str,
    cache_dir: str | None = None,
    storage_options: str = "{}",
    mode: str = "",
) -> None:
    import jax

    jax.config.update("jax_log_compiles", True)  # compiles and cache hits at WARNING
    jax.config.update("jax_explain_cache_misses", True)  # cache misses at WARNING
    counter = _Count()
    logging.getLogger("jax").addHandler(counter)
    from prefect_jax.examples.digits import DigitsProgram
    from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec
    from prefect_jax.training.trainer import Trainer

    # (the example's class, in this process only: its body runs once per trace)
    train_step = DigitsProgram.train_step

    def counted(self, state, batch):
        counter.counts["traced"] += 1
        return train_step(self, state, batch)

    DigitsProgram.train_step = counted

    config = JobConfig(
        program="prefect_jax.examples.digits:tiny",
        job="compiles",
        storage=storage,
        train=TrainSpec(max_steps=80, log_every_steps=10),
        checkpoint=CheckpointSpec(every_steps=20, keep_last=None),
        mlflow_tracking_uri=mlflow_uri,
        compilation_cache_dir=cache_dir,
        storage_options=json.loads(storage_options),
    )
    if mode == "slow-pull":
        from prefect_jax.training.compile_cache_mirror import CompileCacheMirror

        pull = CompileCacheMirror._pull
        CompileCacheMirror._pull = lambda self: (time.sleep(3), pull(self))[1]
    trainer = Trainer(config)
    start = trainer.restore_or_init()
    if mode == "lost":
        from prefect_jax.training.progress import add_progress_listener

        def lose_the_node(step, max_steps, metrics):
            deadline = time.monotonic() + 60
            while not any(name.startswith("jit_step-") for name in trainer.compile_cache.pushed):
                if time.monotonic() > deadline:
                    pushed = trainer.compile_cache.pushed
                    print(json.dumps({"timeout": step, "pushed": pushed}), flush=True)
                    os._exit(3)
                time.sleep(0.05)
            print(json.dumps({"start": start, "lost_at": step, **counter.counts}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        add_progress_listener(lose_the_node)
    while trainer.step < start + 40:
        trainer.train_until_checkpoint()
    trainer.finish()
    trainer.close()
    print(json.dumps({"start": start, "end": trainer.step, **counter.counts}))


if __name__ == "__main__":
    main(*sys.argv[1:])
