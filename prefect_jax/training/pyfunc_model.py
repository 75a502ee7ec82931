"""The MLflow pyfunc of an export (an MLflow "model from code").

MLflow copies this file into every logged model and runs it when the model is loaded, so it
imports only MLflow, JAX and NumPy: ``mlflow.pyfunc.load_model("models:/<name>@best")`` works
in a process that has neither prefect-jax nor the program's module. The model's one artifact,
``jax_export``, is the export's ``model.jax_export`` (the program's ``serve`` with the trained
state baked in, serialized by ``jax.export``).
"""

import mlflow
import mlflow.models
import mlflow.pyfunc
import numpy as np


class JaxExportModel(mlflow.pyfunc.PythonModel):
    """Predicts with a ``jax.export`` artifact: ``predict(inputs) = serve(state, inputs)``."""

    def load_context(self, context):
        import jax

        with open(context.artifacts["jax_export"], "rb") as f:
            self.exported = jax.export.deserialize(bytearray(f.read()))
        self.dtype = self.exported.in_avals[0].dtype

    def predict(self, context, model_input: np.ndarray, params=None):
        # (np.ndarray hints: MLflow validates the input against the logged signature, no inference)
        if hasattr(model_input, "to_numpy"):  # a pandas DataFrame: one row per example
            model_input = model_input.to_numpy()
        return np.asarray(self.exported.call(np.asarray(model_input, dtype=self.dtype)))


mlflow.models.set_model(JaxExportModel())
