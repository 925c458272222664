"""Which running jobs to ask to step aside for an urgent waiter: a pure function.

Cooperative pausing frees room by asking pausable jobs of lower priority to checkpoint and exit;
they are queued again and resumed later. This module decides whom to ask, from plain data, so the
rules can be property-tested:

- only jobs that opted in (`--pausable`), of strictly lower priority than the waiter (or idle, of
  the waiter's own user, where `idle_action = pause`), that have run at least `min_runtime` since
  they last started, and were paused fewer than `max_pauses` times;
- a job already asked (by anyone) is never asked twice, and the room it will free is not promised
  to a second waiter;
- a waiter asks nobody else while a job it asked may still obey (`still_pending`): once that job's
  grace has passed and it runs on, left alone, the waiter may ask others; it waits no longer than
  its own `grace_max` for any one job, whatever grace that job gave itself;
- the cheapest set that frees enough room on one GPU wins: lowest priority first, then least work
  lost (least run time since its last start), then fewest jobs;
- a job whose reload takes long (its time-to-peak from history) is asked only when the waiter
  would otherwise wait longer than that reload.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuwait.core.record import Record

#: The protocol's defaults, in one place: the job's side (gpuwait.checkpoint), the ledger entry,
#: the command line and the settings all take them from here.
DEFAULT_CHECKPOINT_SIGNAL = "USR1"
DEFAULT_GRACE_SECONDS = 120.0
DEFAULT_RESUME_EXIT = 75
DEFAULT_MIN_RUNTIME = 600.0
DEFAULT_MAX_PAUSES = 3
#: The longest a waiter waits for one job it asked before it asks others: a job's --grace is its
#: own to choose, and one of days must not keep urgent work from every other job that would step
#: aside.
DEFAULT_GRACE_MAX = 600.0


class RunningJob(Record, frozen=True):
    """A running job, as far as pausing is concerned."""

    job_id: str
    priority: int
    gpu_uuids: tuple[str, ...]
    #: Bytes it holds on each of its GPUs (max of reservation, real use and the most it grew to).
    holds_bytes: int
    pausable: bool
    #: Seconds since it last started (or resumed).
    run_seconds: float
    pauses: int = 0
    #: Seconds it needs to load back to its peak after a resume; None when unknown.
    reload_seconds: float | None = None
    #: A pause was already requested.
    asked: bool = False
    #: The waiter's own job, holding memory on a GPU that does no work (`idle_action =
    #: pause`): asked to step aside whatever its priority.
    idle: bool = False
    #: Its owner's own rules (None: none recorded): the stricter of theirs and the asker's hold.
    min_runtime: float | None = None
    max_pauses: int | None = None


class PauseRules(Record, frozen=True):
    min_runtime: float = DEFAULT_MIN_RUNTIME
    max_pauses: int = DEFAULT_MAX_PAUSES
    #: The site's: an asker waits for one job it asked at most this long (see still_pending).
    grace_max: float = DEFAULT_GRACE_MAX


class PauseChoice(Record, frozen=True):
    gpu_uuid: str
    victims: tuple[str, ...]
    freed_bytes: int


def still_pending(
    requested_at: float | None,
    signalled_at: float | None,
    grace_seconds: float,
    grace_kill: bool,
    now: float,
    grace_max: float = DEFAULT_GRACE_MAX,
) -> bool:
    """Whether a request to step aside may still be obeyed, so its asker asks nobody else: until
    the job's grace has passed since it was signalled (or, where it never caught the signal,
    since it was asked). After that a job started without --grace-kill is left alone, and its
    asker may ask others; one with --grace-kill gets TERM and ends, so it is waited for.

    The asker's `grace_max` bounds the wait either way: a job that gave itself a grace of days,
    or that ignores the TERM it gets, would otherwise keep the asker from asking any other job
    for as long. Past it the job is left alone by this asker, and still gets its TERM (from its
    own gpuwait) at its own grace."""
    if requested_at is None:
        return False
    since = signalled_at if signalled_at is not None else requested_at
    if now - since > grace_max:
        return False
    return grace_kill or now - since <= grace_seconds


def eligible(
    job: RunningJob, waiter_priority: int, rules: PauseRules, expected_wait: float | None
) -> bool:
    """Whether `job` may be asked to step aside for a waiter of `waiter_priority`."""
    if not job.pausable or job.asked or (job.priority >= waiter_priority and not job.idle):
        return False
    min_runtime = max(rules.min_runtime, job.min_runtime or 0.0)
    max_pauses = (
        rules.max_pauses if job.max_pauses is None else min(rules.max_pauses, job.max_pauses)
    )
    if job.run_seconds < min_runtime or job.pauses >= max_pauses:
        return False
    # Pausing costs the victim its reload; it pays off only if the waiter would wait longer.
    return not (
        job.reload_seconds is not None
        and expected_wait is not None
        and job.reload_seconds >= expected_wait
    )


def choose_victims(
    need_bytes: Mapping[str, int],
    room_bytes: Mapping[str, int],
    waiter_priority: int,
    running: Sequence[RunningJob],
    rules: PauseRules,
    expected_wait: float | None = None,
) -> PauseChoice | None:
    """The jobs to ask on one GPU so that a single-GPU waiter fits, or None if none would do.

    `need_bytes` is what the waiter needs on each GPU it may use; `room_bytes` the room each has
    now (room promised to pauses already under way must be left out by the caller).
    """
    best: tuple[tuple[int, float, int, int], PauseChoice] | None = None
    for uuid, need in need_bytes.items():
        room = room_bytes.get(uuid, 0)
        if room >= need:
            return None  # it fits without pausing anyone; the queue will admit it
        # Only single-GPU victims: pausing part of a gang frees its other GPUs for nobody.
        candidates = sorted(
            (
                j
                for j in running
                if j.gpu_uuids == (uuid,) and eligible(j, waiter_priority, rules, expected_wait)
            ),
            # An idle job loses no work by stepping aside: asked first.
            key=lambda j: (not j.idle, j.priority, j.run_seconds, j.job_id),
        )
        chosen: list[RunningJob] = []
        freed = 0
        for job in candidates:
            if room + freed >= need:
                break
            chosen.append(job)
            freed += job.holds_bytes
        if room + freed < need:
            continue
        cost = (
            max(j.priority for j in chosen),
            sum(j.run_seconds for j in chosen),
            len(chosen),
            -room,
        )
        choice = PauseChoice(uuid, tuple(j.job_id for j in chosen), freed)
        if best is None or cost < best[0]:
            best = (cost, choice)
    return best[1] if best else None
