"""The process that makes a training process's MLflow calls (see `prefect_jax.training.tracking`).

MLflow's import and its store's opening cost much CPU (SQLite: SQLAlchemy, Alembic),
and every write is Python work: in the training process they hold the GIL that the training
loop's dispatch needs. Here they run in a child process, on another core. One child serves
every `Tracker` of its parent; each tracker's calls run in order on a thread of their own, as
they did in-process.

The protocol, pickled frames over the child's stdin and stdout (the child's own prints go to
stderr):

- parent to child: ``("warm", tracking URI)`` (import MLflow now: see `mlflow_client.warm_up`),
  ``("warm_registry", id)`` (make ready what logging a model needs, answered with ``id`` once
  done: see `Tracker.warm_registry`),
  ``("new", key, tracker args, environment)``, ``("call", id, key, method, args, strict)``,
  ``("drop", key)``;
- child to parent: ``(id, ok, value or exception, captured)``, where ``captured`` lists the
  TrackingWarnings and ``prefect_jax`` log records of the call, which the parent raises and
  logs again where its user sees them.

The child ignores SIGTERM and SIGINT (its parent decides when the run ends, within its grace
period) and dies with its parent (Linux ``PR_SET_PDEATHSIG``), so a SIGKILLed trainer leaves
no writer behind that could log what its rerun logs again.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import sys
import threading
import warnings

from prefect_jax.training.mlflow_store import create_sqlite_store, sqlite_path

_capture = threading.local()  # the records of the call running on this thread (None: not in a call)


def _captured() -> list | None:
    return getattr(_capture, "records", None)


class _CaptureLogs(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self._stderr = logging.StreamHandler(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        records = _captured()
        if records is None:
            self._stderr.emit(record)
        else:
            records.append(("log", record.name, record.levelno, record.getMessage()))


def _install_capture() -> None:
    from prefect_jax.training.mlflow_client import TrackingWarning

    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        records = _captured()
        if records is not None and issubclass(category, TrackingWarning):
            records.append(("warning", str(message)))
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    warnings.simplefilter("always", TrackingWarning)
    own = logging.getLogger("prefect_jax")
    own.addHandler(_CaptureLogs())
    own.setLevel(logging.INFO)
    own.propagate = False
    # Every logged model's "Validating input example against model signature" (INFO, MLflow's
    # own format on this process's stderr) would interleave the job's log once per export; a
    # failed check is still an error, and MLflow's warnings still show.
    logging.getLogger("mlflow.pyfunc").setLevel(logging.WARNING)


def _die_with_parent(parent: int) -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the closed pipe ends this process instead
        pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)


def _startup_over() -> None:
    """MLflow is imported (and its store open): freeze what that made and turn the collector on.

    The worker starts with the collector off (`main`): MLflow's import costs less CPU without
    it, CPU that the job's training shares. What the imports left is frozen, out of every later
    collection's walk (as the command does, `prefect_jax.cli.startup.freeze_startup_objects`)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _worker_environment(environment) -> dict:
    """`environment` as this process uses it. JAX (a logged model's check:
    `registry.log_export_model`) runs on the CPU: on a GPU or TPU host it would otherwise open a
    second client on the trainer's accelerator and take its memory (75% of a GPU by default) or
    fail for want of it.

    XLA compiles here without its backend optimisations: a model is run once, on its input
    example, to check that it serves (MLflow's check, with the trained weights as constants, so
    a compile per logged model), never to serve. That compile is shorter without them, and the
    check runs for every exported step.

    MLflow does not look for a uv project in the working directory for a logged model's
    requirements (`registry.requirements` names them), unless the job says otherwise."""
    environment = {**environment, "JAX_PLATFORMS": "cpu"}
    flags = environment.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:  # (one the job sets stays)
        environment["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()
    environment.setdefault("MLFLOW_UV_AUTO_DETECT", "false")
    return environment


def _set_environ(environment) -> None:
    """This process's environment becomes `environment` (with `_worker_environment`'s settings), key
    by
    key: Python code reading it meanwhile never sees it without them. (C code reading it meanwhile
    could read a changing array: JAX starting its client waits for it, ``environ_lock`` in `main`;
    XLA's later reads, at a model's compile, do not.)"""
    wanted = _worker_environment(environment)
    for key in [k for k in os.environ if k not in wanted]:
        del os.environ[key]
    for key, value in wanted.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def main() -> None:
    gc.disable()  # until MLflow is imported: `_startup_over`
    _set_environ(os.environ)
    _die_with_parent(int(sys.argv[1]))
    # bookkeeping: the cores go to training first (PREFECT_JAX_MLFLOW_NICE, default 10; 0 for none)
    try:
        os.nice(int(os.environ.get("PREFECT_JAX_MLFLOW_NICE", "10")))
    except (OSError, ValueError):
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox = sys.stdin.buffer
    outbox = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # MLflow's prints (and anyone's) go to stderr, not into the protocol
    sys.stdout = sys.stderr
    _install_capture()
    # NumPy before any other thread exists: every thread here comes to it (MLflow, JAX,
    # matplotlib, the reader unpickling an input example), and its C extension imported on two
    # threads at once broke the worker ("partially initialized module", then "cannot load module
    # more than once per process"). MLflow imports it anyway.
    import numpy  # noqa: F401

    from prefect_jax.training import mlflow_client, tracking

    send_lock = threading.Lock()
    # a tracker's environment is put in place while JAX starts its client
    environ_lock = threading.Lock()
    # a tracker's first call ran (MLflow imported), warmed up or not
    first_call_done = threading.Event()
    # JAX's and matplotlib's imports (and JAX's start), one thread at a time
    heavy_imports = threading.Lock()
    backends: dict[int, tracking.Tracker] = {}

    def reply(call_id: int, ok: bool, value, records: list) -> None:
        try:
            frame = pickle.dumps((call_id, ok, value, records), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - an answer (or an error) that does not pickle
            frame = pickle.dumps(
                (call_id, False, RuntimeError(f"MLflow worker: {value!r} ({exc!r})"), records)
            )
        with send_lock:
            outbox.write(frame)
            outbox.flush()

    warmed: dict[str, threading.Event] = {}  # tracking URI -> set once its warm-up is over
    warming: set[str] = set()  # the tracking URIs whose warm-up thread is still importing

    def run(call_id: int, backend, name: str, args: tuple, strict: bool) -> None:
        records: list = []
        _capture.records, mlflow_client.strict_here.value = records, strict
        try:
            if (done := warmed.get(backend.tracking_uri)) is not None:
                done.wait(600)  # its store is being opened (or created): once, not twice at a time
            if name == "_register_exports":
                ready_registry()  # (its outcome aside: the call fails with its own error, if any)
            elif name == "_log_learning_curve":
                import_matplotlib()
            value, ok = getattr(backend, name)(*args), True
        except BaseException as exc:  # noqa: BLE001 - goes back to the caller
            value, ok = exc, False
        finally:
            _capture.records = None
            first_call_done.set()
            if not warming:  # else the warm-up's end (matplotlib's imports too)
                _startup_over()  # after the first call at the latest
        reply(call_id, ok, value, records)

    def warm(tracking_uri: str) -> None:
        """Import MLflow and open its store (creating a new SQLite database, whose schema takes
        seconds) before the first tracker asks; then matplotlib (the learning curve, drawn at
        evaluations). A command sends this before its own imports, which then overlap it."""
        try:
            from mlflow.tracking import MlflowClient

            path = sqlite_path(tracking_uri)
            if path is not None:
                import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 - SQLAlchemy, Alembic

                if os.path.isdir(os.path.dirname(path) or "."):  # else the tracker says why
                    if not os.path.exists(path):
                        create_sqlite_store(path)
                    MlflowClient(tracking_uri=tracking_uri).search_experiments(max_results=1)
        except Exception as exc:  # noqa: BLE001 - the tracker's own calls report what is wrong
            print(
                f"prefect-jax MLflow worker: warming up for {tracking_uri}: {exc!r}",
                file=sys.stderr,
            )
        finally:
            warmed[tracking_uri].set()
        try:
            import_matplotlib()
        finally:
            warming.discard(tracking_uri)
            if not warming:
                _startup_over()

    def import_matplotlib() -> None:
        """matplotlib's modules for the learning curve (see ``heavy_imports``)."""
        try:
            with heavy_imports:
                import matplotlib.backends.backend_agg  # noqa: F401
                import matplotlib.figure  # noqa: F401
        except Exception:  # noqa: BLE001 - the curve is drawn without it, or says why
            pass

    registry_lock = threading.Lock()
    registry_outcome: list = []  # [(ok, None or the error)] once `ready_registry` ran

    def ready_registry() -> tuple[bool, Exception | None]:
        """Once per worker (a later caller waits for it and gets its outcome): JAX started on the
        CPU and MLflow's model modules imported (`registry.warm_jax`, `registry.warm_mlflow`), with
        no other thread importing JAX or matplotlib, nor changing the environment, meanwhile."""
        with registry_lock:
            if not registry_outcome:
                try:
                    from prefect_jax.training import registry

                    with heavy_imports:
                        # JAX reads the environment (C getenv) as it starts its client
                        with environ_lock:
                            registry.warm_jax()
                        registry.warm_mlflow()
                    registry_outcome.append((True, None))
                # The first logged model does it again, or says what is wrong.
                except BaseException as exc:  # noqa: BLE001
                    print(
                        f"prefect-jax MLflow worker: making the model registry ready: {exc!r}",
                        file=sys.stderr,
                    )
                    # (its own type would make the parent import JAX's or MLflow's to read it)
                    registry_outcome.append(
                        (
                            False,
                            RuntimeError(
                                f"MLflow worker: making the model registry ready: {exc!r}"
                            ),
                        )
                    )
        return registry_outcome[0]

    def warm_registry(call_id: int) -> None:
        ok, value = False, RuntimeError("MLflow worker: the model registry's warm-up did not end")
        try:
            for event in list(warmed.values()) or [
                first_call_done
            ]:  # MLflow's store first: a tracker's first call waits for it
                event.wait(600)
            ok, value = ready_registry()
        finally:
            reply(call_id, ok, value, [])

    def set_environ(environment) -> None:
        with environ_lock:
            _set_environ(environment)

    def dispatch(message: tuple) -> None:
        kind = message[0]
        if kind == "new":
            _, key, args, environment = message
            backend = backends[key] = tracking.Tracker(*args, _worker_side=True)
            # What the parent's tracker sees (MLflow's settings, credentials), before its calls;
            # on its thread, not this one, which would wait while JAX starts (`ready_registry`).
            backend._pool.submit(set_environ, environment)
        elif kind == "call":
            _, call_id, key, name, args, strict = message
            backend = backends[key]
            backend._pool.submit(run, call_id, backend, name, args, strict)
        elif kind == "warm":
            warmed.setdefault(message[1], threading.Event())
            warming.add(message[1])
            threading.Thread(
                target=warm, args=(message[1],), name="prefect-jax-mlflow-warm", daemon=True
            ).start()
        elif kind == "warm_registry":
            threading.Thread(
                target=warm_registry,
                args=(message[1],),
                name="prefect-jax-mlflow-warm-registry",
                daemon=True,
            ).start()
        elif kind == "drop":
            backend = backends.pop(message[1], None)
            if backend is not None:
                backend._pool.submit(backend._stop_system_metrics)
                backend._pool.shutdown(wait=False)

    while True:
        try:
            message = pickle.load(inbox)
        except EOFError:
            break
        # The stream is no longer readable: end, the parent warns.
        except Exception as exc:  # noqa: BLE001
            print(f"prefect-jax MLflow worker: unreadable call: {exc!r}", file=sys.stderr)
            break
        try:
            dispatch(message)
        except Exception as exc:  # noqa: BLE001 - one bad message must not end the worker
            if message[0] == "call":
                reply(message[1], False, exc, [])
            else:
                print(f"prefect-jax MLflow worker: {message[0]} failed: {exc!r}", file=sys.stderr)
    for backend in backends.values():  # the parent is gone or done: finish what it asked for
        backend._pool.shutdown(wait=True)
        backend._stop_system_metrics()


if __name__ == "__main__":
    main()
