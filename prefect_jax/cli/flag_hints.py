"""What an unknown flag was likely meant to be: the flag spelt with hyphens (``--max_steps``), a
TensorFlow name a porter types (``--save_checkpoints_steps``, ``--model_dir``), or a near miss.
argparse says only "unrecognized arguments"."""

from __future__ import annotations

import difflib
from collections.abc import Callable

# TensorFlow's names (RunConfig, TrainSpec, EvalSpec, the exporters and hooks, absl flags of
# TF's examples, Keras's fit and callbacks), underscores for hyphens, and what says the same here.
TF_NAMES = {
    "model_dir": "--storage and --job (the job's directory is <storage>/<job>)",
    "save_checkpoints_steps": "--checkpoint-every-steps",
    "save_checkpoints_secs": (
        "--checkpoint-every-secs (and --checkpoint-every-steps none for time alone)"
    ),
    "keep_checkpoint_max": "--keep-last",
    "keep_checkpoint_every_n_hours": "--keep-every-secs (hours x 3600)",
    "log_step_count_steps": "--log-every-steps",
    "save_summary_steps": "--log-every-steps",
    "tf_random_seed": "--seed",
    "random_seed": "--seed",
    "steps": "--eval-steps (EvalSpec.steps)",
    "max_steps_without_decrease": "--early-stopping-steps (and --early-stopping-mode min)",
    "max_steps_without_increase": "--early-stopping-steps with --early-stopping-mode max",
    "exports_to_keep": "--exports-to-keep",
    "compare_fn": "--best-compare-fn",
    "hooks": "--train-hook",
    "listeners": "--eval-hook",
    "eval_listener": "--eval-hook",
    "warm_start_from": "--checkpoint-path (the whole state: docs/tensorflow.md)",
    # Keras's fit and its callbacks (docs/tensorflow.md#keras-fit-and-its-callbacks)
    "epochs": "--max-steps (epochs x batches per epoch)",
    "initial_epoch": "--max-steps (a rerun resumes where its job stopped)",
    "steps_per_epoch": "--checkpoint-every-steps (one evaluation per checkpoint)",
    "validation_freq": "--checkpoint-every-steps (one evaluation per checkpoint)",
    "validation_steps": "--eval-steps",
    "patience": "--early-stopping-steps (patience x batches per epoch)",
    "monitor": "--best-metric or --early-stopping-metric",
    "save_best_only": "--best-metric (with --best-mode)",
}


def flag_hint(flag: str, known: list[str]) -> str | None:
    """What `flag` (as typed, ``--name`` or ``--name=value``) was likely meant to be, of the
    parser's `known` option strings, said in a few words; None where nothing is close."""
    name = flag.split("=", 1)[0]
    bare = name.lstrip("-").replace("-", "_")
    if bare in TF_NAMES and TF_NAMES[bare].split()[0] in known:
        return f"{name} is {TF_NAMES[bare]} here"
    hyphens = "--" + bare.replace("_", "-")
    if hyphens in known and hyphens != name:
        return f"{name} is {hyphens} here"
    close = difflib.get_close_matches(hyphens, [k for k in known if k.startswith("--")], n=1)
    return f"{name}: did you mean {close[0]}?" if close and close[0] != name else None


def hints_for(
    given: list[str], known: list[str], command: str, flags_of_roles: Callable[[], dict]
) -> str | None:
    """The hints for the flags in `given` that `command`'s parser does not know (`known`): a
    flag of another subcommand names it (``--once`` is evaluate's), else `flag_hint`."""
    unknown = [a for a in given if a.startswith("--") and a.split("=", 1)[0] not in known]
    if not unknown:
        return None
    roles = flags_of_roles()
    hints = []
    for flag in unknown:
        name = flag.split("=", 1)[0]
        owners = [r for r, flags in roles.items() if r != command and name in flags]
        if owners:
            hints.append(f"{name} is a flag of {' and '.join(owners)}, not {command}")
        elif (hint := flag_hint(flag, known)) is not None:
            hints.append(hint)
    return "; ".join(hints) or None
