"""``python -m prefect_jax.cli``: the ``prefect-jax`` command (how the launcher starts its
processes)."""

from prefect_jax.cli import entry

if __name__ == "__main__":
    entry()
