"""One module per flow (`prefect_jax.flows` imports each when it is first asked for)."""
