"""The background compiles never hold up or fail the training: the first step waits for the train
step's compile only, even when a thread cannot start; a compile that fails is left for the real
call; the process's end waits for every compile thread, also one started by another; and the
state fingerprint's device programs are compiled before the job's end needs them."""

from __future__ import annotations

import logging
import threading

import jax
import pytest

from prefect_jax.training import compiled_steps, trees
from prefect_jax.training.compiled_steps import BackgroundCompile


def test_on_a_cpu_the_eval_step_compiles_after_the_train_step():
    assert jax.default_backend() == "cpu"
    assert not compiled_steps.eval_compiles_beside_train_step()


def test_a_failed_or_unstartable_compile_is_only_logged(caplog, monkeypatch):
    compiling = BackgroundCompile()
    caplog.set_level(logging.DEBUG, logger="prefect_jax.trainer")

    def fails():
        raise ValueError("no such shape")

    compiling.also(fails, name="failing")
    compiling.join()
    assert "background compile (failing) failed" in caplog.text

    def no_thread(target, name):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(BackgroundCompile, "_thread", staticmethod(no_thread))
    compiling.also(fails, name="unstarted")
    assert "background compile (unstarted) not started" in caplog.text


def test_the_first_step_is_not_held_when_the_eval_steps_thread_cannot_start(monkeypatch):
    monkeypatch.setattr(compiled_steps, "eval_compiles_beside_train_step", lambda: True)
    real = BackgroundCompile._thread

    def no_eval_thread(target, name):
        if name == "prefect-jax-compile-eval":
            raise RuntimeError("can't start new thread")
        return real(target, name)

    monkeypatch.setattr(BackgroundCompile, "_thread", staticmethod(no_eval_thread))
    compiled = []
    monkeypatch.setattr(compiled_steps, "precompile_steps", lambda *a: compiled.append("train"))
    monkeypatch.setattr(compiled_steps, "precompile_eval_step", lambda *a: compiled.append("eval"))
    compiling = BackgroundCompile()
    compiling.start((), ())
    waited = threading.Thread(target=compiling.join_train_step, daemon=True)
    waited.start()
    waited.join(30)
    assert not waited.is_alive()  # (before: never, the event unset)
    compiling.join()
    assert compiled == ["train"]


def test_the_end_waits_for_a_compile_that_another_started():
    compiling, done = BackgroundCompile(), []
    release = threading.Event()

    def second():
        release.wait(30)
        done.append("second")

    def first():
        compiling.also(second, name="second")
        done.append("first")

    compiling.also(first, name="first")
    threading.Timer(0.2, release.set).start()
    compiling.join()
    assert sorted(done) == ["first", "second"]


@pytest.mark.parametrize("ahead", [True, False], ids=["compiled-ahead", "not-ahead"])
def test_the_fingerprint_compiles_nothing_once_the_loop_compiled_its_digests(
    job_config, monkeypatch, caplog, ahead
):
    """On an accelerator (a CPU device stands in: its large arrays digested where they are) the
    loop compiles the fingerprint's digests at its first step; without that, the job's end
    compiles them (the case this test must tell apart)."""
    from prefect_jax.training.trainer import Trainer

    def digested_here(leaf):
        return trees.device_digestible(leaf) and leaf.nbytes >= 4096

    monkeypatch.setattr(trees, "_digest_on_device", digested_here)
    jax.clear_caches()  # (the other case's compiles, in this process, are not this one's)
    if not ahead:
        monkeypatch.setattr(BackgroundCompile, "for_live_state", lambda *a: None)
    trainer = Trainer(job_config(max_steps=40, every_steps=20))  # (20: not the end)
    try:
        trainer.restore_or_init()
        trainer.train_until_checkpoint()
        trainer.loop.compiling.join()
        caplog.set_level(logging.WARNING, logger="jax._src.interpreters.pxla")
        with jax.log_compiles():
            trainer.fingerprint()
        messages = [r.getMessage() for r in caplog.records]
        compiled = [m for m in messages if "jit(_device_lanes)" in m]
        assert (not compiled) == ahead, compiled
    finally:
        trainer.close()
