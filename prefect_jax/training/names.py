"""Every name prefect-jax writes where users and other tools read it: MLflow tags, metric
prefixes, experiment and registry names, Prefect event names and flow-run tags, and the files a
step directory holds beside Orbax's.

One home, so a name changes in one place, and so that modules that only share a name (the
tracker and the registry, checkpoints and remote storage) need not import each other. Nothing
here imports anything: every layer may import it, the engine and the Prefect side alike.
"""

# MLflow: the job's run and experiment
DEFAULT_EXPERIMENT = "prefect-jax"
JOB_TAG = (
    "prefect_jax.job"  # on the run: the job's key (job name and storage); how a rerun finds its run
)
STORAGE_TAG = "prefect_jax.storage"  # on the run: the job's storage URL, secrets redacted
KILLED_TAG = "prefect_jax.killed_attempts"  # how many attempts died without closing the run
DEVICES_TAG = "prefect_jax.devices"  # what the newest training attempt runs on
# prefect_jax.param.<key>: a param's value now, where a rerun changed it (MLflow keeps a param's
# first value)
CHANGED_PARAM_TAG = "prefect_jax.param."
STOP_REASON_TAG = "prefect_jax.stop_reason"  # why the job stopped: early stopping, a rerun budget
GOODPUT_TAG = "prefect_jax.goodput"  # the goodput summary in one line
STEP_TAG = "prefect_jax.step"  # on a registered model version: the global step it was exported at
CREATE_TAG = (
    "prefect_jax.create"  # on a logged model: its create call's key (a resend's twin shares it)
)
RUN_NAME_TAG = "mlflow.runName"
NOTE_TAG = "mlflow.note.content"  # the run's description in the MLflow UI
# On the MLflow run: the flow run that trains it now, its UI link; and one link per flow run
# that worked on it (the prefix + its id).
FLOW_RUN_ID_TAG, FLOW_RUN_URL_TAG = "prefect.flow_run_id", "prefect.flow_run_url"
FLOW_RUN_TAG_PREFIX = "prefect.flow_run."
# Where a local store's MLflow UI is (`mlflow ui` serves on this by default); a tracking
# server's own URL is its UI.
MLFLOW_UI_URL_ENV, MLFLOW_UI_URL_DEFAULT = "PREFECT_JAX_MLFLOW_UI_URL", "http://127.0.0.1:5000"
# Where links to a flow run point when its API is not its UI: a command's embedded server's runs
# are browsed afterwards with `prefect server start` (same database), which serves on this.
PREFECT_UI_URL_ENV, PREFECT_UI_URL_LOCAL = "PREFECT_JAX_PREFECT_UI_URL", "http://127.0.0.1:4200"
# the longest tag value written (MLflow 3 takes 8000; older servers 5000)
MAX_TAG_VALUE = 5000
# The experiment's kind (MLflow 3.17's UI picks its view from its sidebar switch instead:
# docs/mlflow.md; other MLflow UIs and clients read the kind).
EXPERIMENT_KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
UI_MODEL_TRAINING = (
    "workflowType=machine_learning"  # the query that opens MLflow's UI in its model-training view
)

# MLflow: metric prefixes (an evaluation's metrics are prefixed with its EvalSpec name)
TRAIN_PREFIX = "train/"
GOODPUT_PREFIX = "goodput/"
RESERVED_EVAL_NAMES = ("train", "goodput", "system")
"""Metric prefixes taken (``train/``, ``goodput/``: prefect-jax's; ``system/``: MLflow's system
metrics): no evaluation's name."""

# The exporters' kinds, as a job's JSON and the command's --exporters name them (one class each in
# `eval_specs`: LatestExporter, BestExporter, FinalExporter).
EXPORTER_KINDS = ("latest", "best", "final")

# MLflow: registry aliases. An exporter moves the alias of its own name, except ``latest``,
# which MLflow reserves (``models:/<name>/latest`` is the highest version): that one is ``newest``.
RESERVED_ALIASES = {"latest": "newest"}

# Prefect: events, their resources, and flow-run tags
CHECKPOINT_EVENT = "prefect-jax.checkpoint.committed"
EVAL_EVENT = "prefect-jax.eval.completed"
EXPORT_EVENT = "prefect-jax.export.completed"
EVENT_STORAGE_LABEL = "prefect-jax.storage"
EVENT_STEP_LABEL = "prefect-jax.step"
OWN_TAG = "prefect-jax"  # on every flow run the package makes (its task runs are untagged)
JOB_RUN_TAG = "job:"  # job:<job>, on every flow run of a job
PROCESS_RUN_TAG = (
    "process:"  # process:<host>:<pid> of a flow run the command runs in its own process
)
MLFLOW_RUN_TAG = (
    "mlflow-run:"  # mlflow-run:<run id>, on every flow run that writes to that MLflow run
)

# Storage: the files of one checkpoint step beside Orbax's own
STEP_META_FILE = (
    "meta/metadata"  # a step's metadata item, the JSON Orbax's JsonCheckpointHandler writes
)
# The job's own files, under <storage>/<job>/ (each in docs/storage.md, with what writes it)
LEASE_FILE, STOP_FILE, ATTEMPTS_FILE = "lease.json", "stop.json", "attempts.json"
GOODPUT_FILE, REGISTRY_FILE = "goodput.json", "registry.json"
BEST_FILE = "best.json"  # exports/<exporter>/best.json: a BestExporter's best so far
EXPORT_INFO_FILE = "export.json"  # exports/<exporter>/<step>/export.json: the export's record
STEP_MANIFEST_FILE = "prefect_jax_manifest.json"  # checksums of the step's files
# Orbax's own last writes of a step: the commit it reads (on GCS, where nothing renames, its
# `atomicity_types.COMMIT_SUCCESS_FILE` comes after)
ORBAX_COMMIT_FILE, GCS_COMMIT_FILE = "_CHECKPOINT_METADATA", "commit_success.txt"
MODEL_FILE = "model.jax_export"  # exports/<exporter>/<step>/model.jax_export: the jax.export
COMMIT_MARKER = "_PREFECT_JAX_COMMITTED"  # written last on remote storage: the step is whole

# MLflow: one tag per attempt that died without closing the run (counted by KILLED_TAG)
KILLED_ATTEMPT_TAG = "prefect_jax.killed."  # prefect_jax.killed.<n>: who the n-th one was

# The flows (by function name) that register exports in the MLflow registry: those that evaluate
# or export (`eval_specs.flow_registers_exports`; the command's MLflow warm-up reads it too)
REGISTERING_FLOWS = ("train_and_evaluate", "evaluate", "export_flow")
