"""The MLflow pyfunc of an export (an MLflow "model from code").

MLflow copies this file into every logged model and runs it when the model is loaded, so it
imports only MLflow, JAX and NumPy: ``mlflow.pyfunc.load_model("models:/<name>@best")`` works
in a process that has neither prefect-jax nor the program's module. The model's one artifact,
``jax_export``, is the export's ``model.jax_export`` (the program's ``serve`` with the trained
state baked in, serialized by ``jax.export``).
"""

import json

import mlflow
import mlflow.models
import mlflow.pyfunc
import numpy as np
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE


class InputRefused(MlflowException, ValueError):
    """An input the model does not take: a ``ValueError`` to Python callers, and an
    ``MlflowException`` to MLflow's scoring server (``mlflow models serve``), which answers
    with its message; any other error becomes "an unexpected error" there, its reason only in
    a stack trace."""

    def __init__(self, message: str):
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)


class JaxExportModel(mlflow.pyfunc.PythonModel):
    """Predicts with a ``jax.export`` artifact: ``predict(inputs) = serve(state, inputs)``, for
    one array, or a dict of arrays where the program's ``serving_input()`` names its inputs."""

    def load_context(self, context):
        import jax

        with open(context.artifacts["jax_export"], "rb") as f:
            self.exported = jax.export.deserialize(bytearray(f.read()))
        args, _ = jax.tree_util.tree_unflatten(self.exported.in_tree, self.exported.in_avals)
        self.inputs = args[0]  # one aval, or {name: aval}
        self.dtype = None if isinstance(self.inputs, dict) else self.inputs.dtype
        # What the export's record (its export.json) says of each input, by name (None for one
        # array): prefect-jax's `serving.input_signature`. None in a model registered before
        # the record was a model file.
        self.recorded = {}
        if "export_info" in context.artifacts:
            with open(context.artifacts["export_info"]) as f:
                recorded = json.load(f).get("inputs") or []
            self.recorded = {one.get("name"): one for one in recorded}

    def predict(self, context, model_input: np.ndarray, params=None):
        # (np.ndarray hints: MLflow validates the input against the logged signature, no inference;
        # named inputs arrive as a dict of arrays)
        if isinstance(self.inputs, dict):
            missing = sorted(set(self.inputs) - set(model_input))
            if missing:
                raise InputRefused(
                    f"the model's inputs are {sorted(self.inputs)}; missing {missing}: give a dict "
                    "of arrays with those names"
                )
            given = {k: np.asarray(model_input[k]) for k in self.inputs}
            self.check_values(given)  # (before the cast: 300 as uint8 is 44)
            args = {k: given[k].astype(a.dtype, copy=False) for k, a in self.inputs.items()}
        else:
            if hasattr(model_input, "to_numpy"):  # a pandas DataFrame: one row per example
                model_input = model_input.to_numpy()
            given = np.asarray(model_input)
            self.check_values(given)
            args = given.astype(self.dtype, copy=False)
        try:
            out = self.exported.call(args)
        except ValueError as exc:
            if not any(word in str(exc).lower() for word in SHAPE_WORDS):
                raise  # (another refusal: a platform the model was not exported for, say)
            # (JAX's own words may not name the input: "Error refining shapes"; a serialized
            # export keeps no symbolic constraint, so the recorded ones are named)
            constraints = [c for one in self.recorded.values() for c in one.get("constraints", [])]
            where = f" where {', '.join(dict.fromkeys(constraints))}" if constraints else ""
            # (JAX's advice to dump the module's IR is for JAX's developers, not a model's user)
            said = str(exc).replace(" Define JAX_DUMP_IR_TO to dump the module.", "").rstrip(".")
            # (past a bound: a sequence longer than the context; not a rank or a dtype refused)
            past = where and "refining shapes" in said.lower()
            fix = "; cut a dimension past its bound (a sequence: keep its last elements)"
            raise InputRefused(
                f"the model takes {jax_tree_str(self.inputs)}{where} (named dimensions: any size "
                f"from 1 within that); given {jax_tree_str(args)}: {said}{fix if past else ''}"
            ) from exc
        if isinstance(out, dict):
            return {k: np.asarray(v) for k, v in out.items()}
        return np.asarray(out)

    def check_values(self, args) -> None:
        """Refuse an integer input outside the values its program declared
        (``serving_input_range()``): token ids of another vocabulary would be looked up as NaN
        or as another token's row, and answered without an error."""
        for name, one in self.recorded.items():
            if "values" not in one:
                continue
            low, high = one["values"]
            array = args[name] if isinstance(args, dict) else args
            if array.size and (array.min() < low or array.max() >= high):
                label = f"input {name!r}" if name is not None else "the input"
                raise InputRefused(
                    f"{label} takes values {low} <= x < {high}; given values from {array.min()} "
                    f"to {array.max()} (token ids of another vocabulary or tokenizer, say)"
                )


SHAPE_WORDS = ("shape", "rank", "dimension", "dtype")
"""What JAX's refusals of an input's shape say (a platform's refusal says none of them)."""


def jax_tree_str(arrays) -> str:
    """``int32[b,seq]`` (an aval) or ``int32[2,40]`` (an array); a dict of them by name."""
    if isinstance(arrays, dict):
        return "{" + ", ".join(f"{k!r}: {jax_tree_str(v)}" for k, v in arrays.items()) + "}"
    dims = ",".join(str(d) for d in arrays.shape)
    return f"{np.dtype(arrays.dtype).name}[{dims}]"


mlflow.models.set_model(JaxExportModel())
