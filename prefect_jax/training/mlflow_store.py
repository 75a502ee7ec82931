"""New MLflow SQLite stores, made whole or not at all, and quickly (the MLflow worker's).

A new store's schema takes seconds of Alembic migrations: a store starts as a copy of one empty
store per machine (`store_template`, in the cache root), made once by those migrations. A store
or a template is built under another name beside its own, which it takes only once whole
(`built_beside`), so that a worker killed part-way (its command refused, its parent killed)
leaves no half-built store behind; the next one removes what a dead one left.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

# <database>.prefect-jax-new-<host>-<pid>: a store being created
NEW_STORE_SUFFIX = ".prefect-jax-new-"
SQLITE_PREFIX = "sqlite:///"  # then the file's path: relative, or absolute with a fourth slash


def sqlite_path(tracking_uri: str) -> str | None:
    """The database file of a SQLite tracking URI (``sqlite:///<path>``), or None for another
    store (a server, or a URI in a form MLflow refuses: `mlflow_reach` says which)."""
    if tracking_uri.startswith(SQLITE_PREFIX):
        return tracking_uri[len(SQLITE_PREFIX) :]
    return None


@contextlib.contextmanager
def built_beside(path: str) -> Iterator[str]:
    """The name ``<path>.prefect-jax-new-<host>-<pid>`` to build a file under, beside `path`,
    before it takes `path`'s name whole; removed afterwards if still there. What dead processes of
    this host left under such names is removed first (only this host's can be proven dead)."""
    import glob
    import re
    import socket

    from prefect_jax.training.local_processes import process_alive

    prefix = f"{path}{NEW_STORE_SUFFIX}{socket.gethostname()}-"
    for stale in glob.glob(glob.escape(prefix) + "*"):
        # <pid> or <pid>-journal only (a host named <host>-<digits> has files that start alike)
        mine = re.fullmatch(r"(\d+)(-journal|-wal|-shm)?", stale[len(prefix) :])
        if mine and not process_alive(int(mine.group(1))):
            try:
                os.remove(stale)  # with its journal, if any: both match
            except FileNotFoundError:
                pass
    building = f"{prefix}{os.getpid()}"
    try:
        yield building
    finally:
        if os.path.exists(building):
            os.remove(building)


def store_template() -> str | None:
    """An empty MLflow SQLite store (MLflow's tables at their newest schema, no rows) for this
    MLflow and SQLAlchemy, kept in the cache root (``PREFECT_JAX_CACHE_DIR``, default
    ``~/.cache/prefect-jax``): made once per machine by MLflow's own migrations (seconds of CPU),
    then
    copied (a file copy) for each new store. Written whole or not at all. None where it cannot
    be made (a read-only cache, another MLflow's private API): stores are then made as MLflow
    makes them."""
    try:
        import mlflow
        import sqlalchemy
        from mlflow.store.db.utils import _initialize_tables

        from prefect_jax.training.storage import cache_root

        folder = os.path.join(cache_root(), "mlflow-store-templates")
        template = os.path.join(
            folder, f"mlflow-{mlflow.__version__}-sqlalchemy-{sqlalchemy.__version__}.db"
        )
        if os.path.exists(template):
            return template
        os.makedirs(folder, exist_ok=True)
        with built_beside(template) as building:
            engine = sqlalchemy.create_engine(f"sqlite:///{building}")
            try:
                # tables only: the default experiment names its store's folder
                _initialize_tables(engine)
            finally:
                engine.dispose()
            os.replace(building, template)
        return template
    except Exception as exc:  # noqa: BLE001 - the store is made without one
        print(f"prefect-jax MLflow worker: no store template: {exc!r}", file=sys.stderr)
        return None


def open_store(path: str) -> None:
    """Open the MLflow store at `path` as MLflow does (creating its tables and its default
    experiment where missing), then close its connections: the file takes another name next."""
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments(max_results=1)
    finally:
        # no connection left open under the file's other name (MLflow's own attributes: best effort)
        try:
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            engine = SqlAlchemyStore._engine_map.get(f"sqlite:///{path}")
            if engine is not None:
                engine.dispose()
        except Exception:  # noqa: BLE001
            pass


def create_sqlite_store(path: str) -> None:
    """A new MLflow SQLite store at `path`, made whole or not at all.

    Its schema takes seconds of Alembic migrations: the store starts as a copy of an empty one
    (`store_template`), and a warm-up makes it before anyone asks. Its command may be refused
    (bad input) and end meanwhile, killing this process part-way. So the store is made in a file
    beside `path`, which then takes that name, unless a store was made there meanwhile (a hard
    link never replaces one). What a killed worker left is removed here, by the next one."""
    import shutil

    with built_beside(path) as building:
        template = store_template()
        if template is not None:
            shutil.copyfile(template, building)
        try:
            open_store(building)
        except Exception as exc:
            if template is None:
                raise
            # Unreadable, or not this MLflow's schema: made again by the migrations, and the store
            # too.
            print(
                f"prefect-jax MLflow worker: store template {template} not usable ({exc!r}): "
                "removed",
                file=sys.stderr,
            )
            for bad in (template, building):
                if os.path.exists(bad):
                    os.remove(bad)
            open_store(building)
        try:
            os.link(building, path)
        except FileExistsError:  # another process made one meanwhile: that one is the store
            pass
