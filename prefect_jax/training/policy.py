"""The checkpoint policy of one job: when it saves, when it backs up, which steps it keeps.

One home for the whole save decision, as levanter's `Checkpointer.on_step` and Orbax's
`CheckpointManagerOptions` are: the trainer asks `CheckpointPolicy` where its interval ends,
whether a checkpoint or a backup is due, and Orbax's retention is built here too (the Orbax
preservation policies, and `retained` for storage Orbax does not manage). Orbax is imported only
where its preservation policy is built: importing this module imports neither jax nor prefect.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Literal

from prefect_jax.training.goodput_summary import LOST_PROCESS
from prefect_jax.training.specs import CheckpointSpec

logger = logging.getLogger("prefect_jax.trainer")

BACKUP_WINDOW = 5  # the newest attempts a backup interval is estimated from
MIN_BACKUP_SECS = 1.0


# The boundary of a job without a last step whose cadence is by time only: never reached.
NO_END = 2**62


class CheckpointPolicy:
    """When a job writes a checkpoint, when it writes a backup, and which steps it keeps.

    Built from the job's `CheckpointSpec` (`from_spec`); the knobs are the spec's fields, and
    what each decides is said here once:

    Args:
        every_steps: a regular checkpoint at each multiple of this step: `next_boundary` is the
            next multiple past the live step (None: by time only).
        every_secs: a regular checkpoint once this many seconds passed since the last save
            (`due`, `saved`; None: by steps only). Whichever cadence comes first writes.
        max_steps: the last step: always checkpointed, and no boundary lies past it. None for
            a policy that decides retention only (a `Checkpoints` opened to read), or, with
            `forever`, for a job that trains until stopped (`for_training`).
        keep_last: retention keeps the newest this many regular steps (None: every one).
        keep_every_steps: retention also keeps every regular step that is a multiple of this.
        keep_every_secs: retention also keeps the oldest regular step saved in each window of
            this many seconds of wall-clock time (`kept_by_time`).
        keep_until_evaluated: retention also keeps every regular step from the newest evaluated
            one on, so that it never deletes a step before a separate evaluator reached it
            (None or False: off; `spec_for_role` turns it on for the `train` role).
        backups: once attempts of the job were killed without notice, also write *backups*
            between the cadence's checkpoints, every `backup_every` seconds (Young/Daly, see
            `backup_interval`): resume-only steps, never evaluated, kept only while they are
            the newest step (they do not count in `keep_last`).
        clock: monotonic seconds, for the time cadence and backups (a fake one in tests).
        wall_clock: epoch seconds, the goodput ledger's time, for the backup interval.
        forever: the job has no last step (``TrainSpec(max_steps=None)``): boundaries follow
            the cadence alone, without end.
    """

    def __init__(  # (no defaults: `from_spec` gives CheckpointSpec's, their one home)
        self,
        *,
        every_steps: int | None,
        every_secs: float | None,
        max_steps: int | None,
        keep_last: int | None,
        keep_every_steps: int | None,
        keep_until_evaluated: bool | None,
        backups: bool,
        keep_every_secs: float | None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        forever: bool = False,
    ):
        self.every_steps, self.every_secs, self.max_steps = every_steps, every_secs, max_steps
        self.forever = forever and max_steps is None
        self.keep_last, self.keep_every_steps = keep_last, keep_every_steps
        self.keep_every_secs = keep_every_secs
        self.keep_until_evaluated, self.backups = bool(keep_until_evaluated), backups
        self.clock, self.wall_clock = clock, wall_clock
        self.last_save = clock()  # when the live state was last saved, or training began

    @classmethod
    def from_spec(
        cls, spec: CheckpointSpec | None, max_steps: int | None = None, **clocks
    ) -> CheckpointPolicy:
        """The policy of `spec` (the defaults if None) for a job that trains to `max_steps`."""
        spec = spec or CheckpointSpec()
        return cls(
            every_steps=spec.every_steps,
            every_secs=spec.every_secs,
            max_steps=max_steps,
            keep_last=spec.keep_last,
            keep_every_steps=spec.keep_every_steps,
            keep_until_evaluated=spec.keep_until_evaluated,
            backups=spec.backups,
            keep_every_secs=spec.keep_every_secs,
            **clocks,
        )

    @classmethod
    def for_training(
        cls, spec: CheckpointSpec | None, max_steps: int | None, **clocks
    ) -> CheckpointPolicy:
        """The policy of a trainer of a job that trains to `max_steps` (None: until stopped)."""
        policy = cls.from_spec(spec, max_steps, **clocks)
        policy.forever = max_steps is None
        return policy

    @staticmethod
    def spec_for_role(
        spec: CheckpointSpec, role: Literal["train", "train_and_evaluate"]
    ) -> CheckpointSpec:
        """`spec` with its role's default: for ``train``, whose evaluator runs elsewhere,
        `keep_until_evaluated` None means on; ``train_and_evaluate`` evaluates each step itself."""
        if role == "train" and spec.keep_until_evaluated is None:
            return spec.model_copy(update={"keep_until_evaluated": True})
        return spec

    # -- cadence ---------------------------------------------------------------------------

    def next_boundary(self, step: int) -> int:
        """The next step past `step` at which a checkpoint is due by step cadence (or max_steps)."""
        if self.max_steps is None and not self.forever:
            raise ValueError("this checkpoint policy has no max_steps: it decides retention only")
        if self.every_steps is None:  # by time only: the interval ends when `due` says so
            return self.max_steps if self.max_steps is not None else NO_END
        cadence = (step // self.every_steps + 1) * self.every_steps
        return cadence if self.max_steps is None else min(self.max_steps, cadence)

    def is_off_cadence(self, step: int) -> bool:
        """A checkpoint of `step` is no regular one (a preemption's: resumed from, not
        evaluated)."""
        every = self.every_steps
        return (self.forever or (self.max_steps is not None and step < self.max_steps)) and not (
            every and step % every == 0
        )

    def saved(self) -> None:
        """The live state was just saved (or training starts on a restored one): the time cadence
        counts from now."""
        self.last_save = self.clock()

    def due(
        self,
        part_started: float,
        backup_every: float | None,
        forced: bool = False,
        busy: Callable[[], bool] = lambda: False,
        compile_wait: float = 0.0,
    ) -> Literal["checkpoint", "backup"] | None:
        """What is due now within a training part that began at `part_started` (`clock` time).

        ``"checkpoint"`` when `forced` (a preemption notice, a lost lease) or `every_secs` passed
        since the last save; else ``"backup"`` once `backup_every` seconds passed in the part
        (not counting the evaluations, exports or task runs before it: they trained nothing a
        backup would keep) unless `busy()` (remote storage still uploading the step before);
        else None. Neither counts `compile_wait`, the seconds of this part's first dispatch in a
        new loop (the loop's `compile_s`: its compile or cache load, its batch and its run): a
        rerun's first step on a GPU can wait as long as a cadence, and a save right after it
        keeps one step."""
        now = self.clock() - compile_wait
        if forced or (self.every_secs is not None and now - self.last_save >= self.every_secs):
            return "checkpoint"
        if backup_every is not None and now - part_started >= backup_every and not busy():
            return "backup"
        return None

    def backup_every(self, ledger, job: str) -> float | None:
        """Seconds between backups for `job` now, from its goodput `ledger` (`backup_interval`
        over its earlier attempts and this one), or None: none due. Said once per attempt, in
        the log and in the attempt's ledger entry (``backup_every_secs``)."""
        attempt = ledger.attempt
        if not self.backups or attempt is None or ledger.earlier is None:
            return None
        found = backup_interval(ledger.earlier, attempt, now=self.wall_clock())
        if found is None:
            return None
        seconds, why = found
        if attempt.get("backup_every_secs") is None:
            cost = (
                "no save timed yet"
                if why["save_secs"] is None
                else f"a save blocking training {why['save_secs']:.3f}s"
            )
            logger.warning(
                "job %s: %d of its %d latest attempts were killed without notice "
                "(one every %.1fs past their "
                "start-up): backing up every %.1fs between checkpoints (Young/Daly, with %s); "
                "CheckpointSpec(backups=False) turns this off",
                job,
                why["killed"],
                why["of_attempts"],
                why["mean_secs_between_kills"],
                seconds,
                cost,
            )
        attempt["backup_every_secs"] = round(seconds, 3)
        return seconds

    # -- retention -------------------------------------------------------------------------

    def retained(
        self,
        steps: list[int],
        newest_evaluated: int | None,
        is_backup: Callable[[int], bool],
        saved_at: Callable[[int], float | None] = lambda step: None,
    ) -> set[int]:
        """The steps of `steps` (committed, oldest first) that retention keeps: what `preservation`
        keeps in Orbax, for storage Orbax does not manage (`RemoteSteps`)."""
        regular = [s for s in steps if not is_backup(s)]
        keep = set(regular[-self.keep_last :]) if self.keep_last else set(regular)
        if self.keep_every_steps:
            keep |= {s for s in regular if s % self.keep_every_steps == 0}
        if self.keep_every_secs:
            keep |= kept_by_time(regular, saved_at, self.keep_every_secs)
        if self.keep_until_evaluated:
            keep |= {s for s in regular if newest_evaluated is None or s >= newest_evaluated}
        return keep | set(steps[-1:])

    def preservation(
        self,
        is_backup: Callable[[int], bool],
        pinned: Callable[[int], bool],
        newest_evaluated: Callable[[], int | None] | None = None,
        saved_at: Callable[[int], float | None] = lambda step: None,
    ):
        """Retention as an Orbax preservation policy (`CheckpointManagerOptions`): `retained`'s
        rule over Orbax's steps; a step `pinned` says is still needed is kept whatever it says."""
        from orbax.checkpoint import checkpoint_managers as pp

        policies = [pp.LatestN(n=self.keep_last)]
        if self.keep_every_steps:
            policies.append(pp.EveryNSteps(interval_steps=self.keep_every_steps))
        if self.keep_until_evaluated and newest_evaluated is not None:
            policies.append(KeepNotYetEvaluated(newest_evaluated))
        if self.keep_every_secs:
            policies.append(KeepEveryInterval(self.keep_every_secs, saved_at))
        return BackupsWhileNewest(pp.AnyPreservationPolicy(policies), is_backup, pinned)


def retained(
    steps: list[int],
    spec: CheckpointSpec,
    newest_evaluated: int | None,
    is_backup: Callable[[int], bool],
    saved_at: Callable[[int], float | None] = lambda step: None,
) -> set[int]:
    """`CheckpointPolicy.retained` of `spec`."""
    return CheckpointPolicy.from_spec(spec).retained(steps, newest_evaluated, is_backup, saved_at)


def kept_by_time(
    steps: list[int], saved_at: Callable[[int], float | None], every_secs: float
) -> set[int]:
    """TF's ``keep_checkpoint_every_n_hours``: of `steps`, the oldest saved in each window of
    `every_secs` of wall-clock time (``saved_at // every_secs``, by the time each step's
    metadata records). A step's fate depends on its own window only, so a step kept stays kept
    whatever else is deleted or set aside; a step whose time could not be read is kept."""
    oldest: dict[int, int] = {}
    unknown: set[int] = set()
    for step in steps:
        at = saved_at(step)
        if at is None:
            unknown.add(step)
        else:
            window = int(at // every_secs)
            oldest[window] = min(step, oldest.get(window, step))
    return set(oldest.values()) | unknown


@dataclasses.dataclass
class KeepEveryInterval:
    """An Orbax preservation policy: `kept_by_time` over Orbax's steps, the rule the uploads'
    retention follows too (Orbax's own ``EveryNSeconds`` chains each kept step to the last one,
    so a step set aside changes which later ones it keeps)."""

    every_secs: float
    saved_at: Callable[[int], float | None]

    def should_preserve(self, checkpoints, *, context):
        kept = kept_by_time([c.step for c in checkpoints], self.saved_at, self.every_secs)
        return [c.step in kept for c in checkpoints]


@dataclasses.dataclass
class KeepNotYetEvaluated:
    """An Orbax preservation policy: keep every step from the newest evaluated one on, so that
    retention never deletes a step before a separate evaluator reached it (and the newest
    evaluated step stays readable for its exports)."""

    newest_evaluated: Callable[[], int | None]

    def should_preserve(self, checkpoints, *, context):
        newest = self.newest_evaluated()
        return [newest is None or c.step >= newest for c in checkpoints]


@dataclasses.dataclass
class BackupsWhileNewest:
    """An Orbax preservation policy: `inner` decides over the steps that are not backups (see
    `CheckpointSpec.backups`), and a backup is kept only while it is the newest step: any newer
    step, backup or not, supersedes it. A step `pinned` says is still needed (its upload to
    remote storage is pending) is kept whatever they say."""

    inner: Any
    is_backup: Callable[[int], bool]
    pinned: Callable[[int], bool] = lambda step: False

    def should_preserve(self, checkpoints, *, context):
        regular = [c for c in checkpoints if not self.is_backup(c.step)]
        kept = dict(
            zip(
                (c.step for c in regular),
                self.inner.should_preserve(regular, context=context),
                strict=True,
            )
        )
        newest = max((c.step for c in checkpoints), default=None)
        return [
            (kept[c.step] if c.step in kept else c.step == newest) or self.pinned(c.step)
            for c in checkpoints
        ]


# -- the backup interval (Young/Daly) ----------------------------------------------------------


def _save_cost(attempts: list[dict]) -> tuple[float, int] | None:
    """Seconds a save blocked the training thread, on average over the saves `attempts` timed
    (`GoodputLedger.saved`); None before any was."""
    blocked, saves = (
        sum(a.get("save_s", 0.0) for a in attempts),
        sum(a.get("saves", 0) for a in attempts),
    )
    return (blocked / saves, saves) if saves else None


def _exposed(a: dict, end: float) -> float:
    """An attempt's time from the end of its start-up, restore and compile to `end`."""
    dead = sum(a.get("seconds", {}).get(k, 0.0) for k in ("startup", "restore", "compile"))
    return max(0.0, end - a["process_start"] - dead)


def backup_interval(
    earlier: list[dict],
    current: dict | None = None,
    now: float | None = None,
    window: int = BACKUP_WINDOW,
) -> tuple[float, dict[str, Any]] | None:
    """How often to back up a job whose attempts get killed without notice (Young/Daly).

    An attempt was *killed* when a later one exists and it never recorded an end (SIGKILL, a lost
    node, an OOM kill), or it ended `LOST_PROCESS` (such a kill took another process of a
    multi-process job): what it trained after its last checkpoint was lost. One that ended on a
    preemption notice lost nothing (its step in flight was checkpointed) and is not a kill.
    Over the newest `window` attempts before `current` and `current` itself (until `now`), the
    mean time between kills ``M`` is their time past start-up, restore and compile (a killed
    one's until its last record: it was killed less than one save interval later) divided by
    the kills. With ``C`` the seconds a save blocks training (timed, over the same attempts),
    ``sqrt(2 * C * M)`` seconds between checkpoints minimise the expected loss, the first-order
    optimum of Young (1974) and Daly (2006); never under ``max(MIN_BACKUP_SECS, 5 * C)``.

    Before any save of theirs was timed (every one was killed before its first checkpoint, as
    happens when kills come more often than checkpoints: such a job would never get past its
    first step), ``MIN_BACKUP_SECS``: that backup times a save, and the next follow the formula.

    Returns ``(seconds, why)`` (``why``: the figures it came from; ``save_secs`` None before a
    save was timed), or None when none of those attempts was killed.
    """
    now = time.time() if now is None else now
    recent = [a for a in earlier if not a.get("folded")][-window:]
    following = recent[1:] + ([current] if current is not None else [])
    kills = sum(
        a.get("ended") in (None, LOST_PROCESS) for a, _ in zip(recent, following, strict=False)
    )
    if not kills:
        return None
    exposed = sum(_exposed(a, a.get("updated", a["process_start"])) for a in recent)
    if current is not None:
        exposed += _exposed(current, now)
    cost = _save_cost(recent + ([current] if current is not None else []))
    mtbk = max(exposed / kills, 1e-3)
    why = {
        "killed": kills,
        "of_attempts": len(following),
        "mean_secs_between_kills": round(mtbk, 2),
        "save_secs": round(cost[0], 4) if cost else None,
        "saves_timed": cost[1] if cost else 0,
    }
    # killed before any save: one as soon as allowed, which times what a save costs
    if cost is None:
        return MIN_BACKUP_SECS, why
    return max(math.sqrt(2.0 * cost[0] * mtbk), MIN_BACKUP_SECS, 5.0 * cost[0]), why
