"""What wraps each flow's body: its task runs without the flow run's own tags, and MLflow warmed up
while the program imports."""

# No `from __future__ import annotations`: see prefect_jax/flows/__init__.py.
import functools
import inspect

from prefect_jax.tasks.notices import end_if_notice
from prefect_jax.training.names import JOB_RUN_TAG, MLFLOW_RUN_TAG, OWN_TAG, PROCESS_RUN_TAG
from prefect_jax.training.preemption import deliver_lost_notices, forget_ctrl_c
from prefect_jax.training.specs import flow_registers_exports

_OWN_TAGS = (OWN_TAG,)
_RUN_TAG_PREFIXES = (
    PROCESS_RUN_TAG,
    MLFLOW_RUN_TAG,
)  # name one flow run: its process, its MLflow run
_OWN_TAG_PREFIXES = (JOB_RUN_TAG, *_RUN_TAG_PREFIXES)


def _task_tags():
    """The tags context for this flow's task runs: the caller's, less the ones prefect-jax puts on
    its flow runs (``prefect-jax``, ``job:``, ``process:``, ``mlflow-run:``), which name the flow
    run.

    Prefect gives every task run the tags in context, and a task run with tags asks the server's
    concurrency service for slots on each of them (`prefect/task_engine.py`): a round trip through
    Prefect's event-loop thread per task run, which stalled now and then on a small machine. A
    tag a person set (a tag-based concurrency limit on the GPU tasks, say) stays and is
    honoured."""
    from prefect.context import TagsContext

    current = TagsContext.get().current_tags
    keep = {t for t in current if t not in _OWN_TAGS and not t.startswith(_OWN_TAG_PREFIXES)}
    return TagsContext(current_tags=keep)


def flow_body(fn):
    """A flow's body as prefect-jax runs it (its signature kept, for Prefect's parameters): lost
    SIGTERM notices delivered again, an earlier run's Ctrl-C forgotten, MLflow warmed up in its
    worker process, the task runs without the flow run's own tags (`_task_tags`)."""

    @functools.wraps(fn)
    def body(*args, **kwargs):
        from prefect_jax.training.mlflow_client import warm_up

        deliver_lost_notices()  # (again: someone may have replaced the hook since the import)
        forget_ctrl_c()  # a Ctrl-C before, in this notebook or session, stopped an earlier run
        # A deployment's flow run too: MLflow imports in its worker while the program imports here
        # (and, where the flow registers exports, what logging a model needs).
        arguments = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
        registry = flow_registers_exports(fn.__name__, arguments.get("eval_spec"))
        warm_up(arguments.get("mlflow_tracking_uri"), registry=registry)
        with _task_tags():
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:  # a notice between task runs: the trainers end first
                end_if_notice(exc)
                raise

    return body
