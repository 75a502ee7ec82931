"""A public-style Flax NNX model with sharding annotations, as a program: run through `Loop` by
`sharding_job.py`, and through the command by `test_sharding.py` (``annotated_program:program``,
its ``axis`` a program param), with 8 CPU devices."""

import pydantic


class Annotated:
    """A public-style Flax NNX model with sharding annotations (``nnx.with_partitioning``), as
    it is: its init takes no mesh, its shardings are Flax's own (`nnx.get_partition_spec`)."""

    mesh_axes = {"data": 4, "model": 2}
    axis = "model"  # the mesh axis its kernel's annotation names

    def init(self, rng):
        from flax import nnx

        kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, self.axis))
        return nnx.state(nnx.Linear(8, 16, kernel_init=kernel, rngs=nnx.Rngs(rng)))

    def shardings(self, abstract_state, mesh):
        from flax import nnx

        return nnx.get_partition_spec(abstract_state)

    def _loss(self, state, batch):
        pred = batch["x"] @ state["kernel"][...] + state["bias"][...]
        return ((pred - batch["y"]) ** 2).mean()

    def train_step(self, state, batch):
        import jax

        loss, grads = jax.value_and_grad(self._loss)(state, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads), {"loss": loss}

    def eval_step(self, state, batch):
        return {"loss": (self._loss(state, batch) * 8, 8.0)}

    def _data(self, n):
        import grain
        import numpy as np

        def batch(i):
            x = np.random.default_rng(i).normal(size=(8, 8)).astype(np.float32)
            return {"x": x, "y": np.repeat(x.sum(1, keepdims=True), 16, 1)}

        return grain.MapDataset.range(n).map(batch)

    def train_data(self, seed):
        return self._data(1000).repeat()

    def eval_data(self):
        return self._data(2)


class Params(pydantic.BaseModel):
    axis: str = "model"


def program(params: Params) -> Annotated:
    made = Annotated()
    made.axis = params.axis
    return made
