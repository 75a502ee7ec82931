"""The waits (TF's `recover_session` wait_for_checkpoint, max_wait_secs, recovery_wait_secs;
EvalSpec's start_delay_secs) and BestExporter's compare_fn reach the flows and the command."""

from __future__ import annotations

import time

import pytest

from prefect_jax.cli import build_parser
from prefect_jax.cli.spec_flags import specs_from_args
from prefect_jax.flows import export_flow
from prefect_jax.training.specs import TrainSpec


def _args(role: str, *flags: str):
    return build_parser().parse_args(
        [role, "--program", "prefect_jax.examples.digits:tiny", "--job", "j", "--storage", "/s"]
        + list(flags)
    )


def test_start_delay_and_compare_fn_come_from_the_command():
    """`--start-delay-secs` is EvalSpec's start_delay_secs; `--best-compare-fn` the best
    exporter's compare_fn (TF's BestExporter compare_fn), with no metric or mode of its own."""
    _, eval_spec, _ = specs_from_args(_args("evaluate", "--start-delay-secs", "7"))
    assert eval_spec.start_delay_secs == 7
    _, eval_spec, _ = specs_from_args(
        _args("run", "--best-compare-fn", "tests.programs:higher_accuracy")
    )
    (best,) = [e for e in eval_spec.exporters if e.name == "best"]
    assert (best.compare_fn, best.metric, best.mode) == (
        "tests.programs:higher_accuracy",
        None,
        None,
    )
    _, eval_spec, _ = specs_from_args(_args("run"))  # TF's default: loss, lower is better
    (best,) = [e for e in eval_spec.exporters if e.name == "best"]
    assert (best.compare_fn, best.metric, best.mode) == (None, "loss", "min")


def test_compare_fn_beside_best_metric_or_mode_is_refused_naming_both_flags():
    for flags in (["--best-metric", "accuracy"], ["--best-mode", "max"]):
        args = _args("run", "--best-compare-fn", "tests.programs:higher_accuracy", *flags)
        with pytest.raises(ValueError, match=rf"--best-compare-fn .* and {flags[0]} {flags[1]}"):
            specs_from_args(args)


def test_the_wait_flags_reach_their_parameters():
    args = _args("evaluate", "--max-wait-secs", "5")  # TF's name for the evaluator's first wait
    assert args.wait_for_first_checkpoint_secs == 5
    args = _args(
        "export", "--wait-for-checkpoint", "--max-wait-secs", "3", "--recovery-wait-secs", "0.5"
    )
    assert (args.wait_for_checkpoint, args.max_wait_secs, args.recovery_wait_secs) == (
        True,
        3,
        0.5,
    )


@pytest.mark.usefixtures("prefect_server")
def test_the_export_flow_waits_max_wait_secs_for_a_step_then_says_there_is_none(
    tmp_path, mlflow_uri
):
    """TF's recover_session(wait_for_checkpoint=True, max_wait_secs=...): the export flow of a
    job with nothing to export looks every recovery_wait_secs for max_wait_secs, then fails
    saying so (without the wait it fails at once)."""
    started = time.monotonic()
    state = export_flow(
        program="prefect_jax.examples.digits:tiny",
        job="empty",
        storage=str(tmp_path / "storage"),
        train_spec=TrainSpec(max_steps=40),
        mlflow_tracking_uri=mlflow_uri,
        wait_for_checkpoint=True,
        max_wait_secs=2,
        recovery_wait_secs=0.5,
        return_state=True,
    )
    assert time.monotonic() - started >= 2
    assert state.is_failed()
    with pytest.raises(
        ValueError, match="job 'empty' has no committed checkpoint.*max_wait_secs=2"
    ):
        state.result()
