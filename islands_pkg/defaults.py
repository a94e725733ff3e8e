"""The one definition of the service's defaults that the pure cores and the job config share.

The job config (``orchestrator/config.py``: pydantic) and the cores it is built into
(``SyncerSettings``, ``FleetSettings``, ``RegionPlan``, ``RestartPolicy``: plain dataclasses, no
pydantic, no Ray) read their defaults from here, so a core built by hand (the in-process driver,
``run_task``, the studies, the benchmarks, the tests) runs the service's rules unless it says
otherwise. ``tests/unit/test_defaults.py`` checks every field against ``build``'s. Plain values
only: the cores turn the strings into their enums.
"""

# -- syncer (config: syncer.*) ---------------------------------------------------------------------
OVERLAP_STEPS = 2                 # τ
HISTORY_VERSIONS = 8
MAX_STALENESS = None
OUTLIER_NORM_FACTOR = 10.0
STALENESS_DISCOUNT = 0.0
MERGE_RULE = "rda"
PARTICIPATION_SCALE = True
# The asynchrony rules (BENCHMARKS.md, "Quality under asynchrony": they win on a fleet out of
# phase and are the same numbers as pull / per_merge / learner / 0 when every round merges whole).
OUTER_GRADIENT = "rebased"
ROUND_STEP = "per_round"
STALENESS_SHARE = 0.0
SCHEDULE_CLOCK = "fleet"
ROUND_WAIT = 0.5
# The downlink shadows kept per fragment (learners at one base share one); None: no bound, so a
# learner whose copy diverged from the others' still gets encoded replies. A bound trades syncer
# memory for full fp32 replies to the learners past it.
DOWNLINK_MAX_SHADOWS = None

# -- quorum (config: quorum.*) ---------------------------------------------------------------------
MIN_LEARNERS = 1                  # K
GRACE_GAMMA = 0.5
GRACE_CAP_S = 5.0

# -- health (config: health.*) ---------------------------------------------------------------------
HEARTBEAT_TIMEOUT_S = 10.0
STRAGGLER_FACTOR = 4.0
STRAGGLER_WINDOW_S = 30.0
STRAGGLER_MIN_EXCESS_S = 0.05
SPARES = 0
SPARE_WAIT_S = 10.0
PRESTART_RESTARTS = True
# A learner gives up on its unanswered pushes after the heartbeat timeout; one still draining a
# timeout later cannot leave by itself.
DRAIN_TIMEOUT_FACTOR = 2.0

# -- restarts (config: health.restart.*) -----------------------------------------------------------
BACKOFF_INITIAL_S = 0.5
BACKOFF_MULTIPLIER = 2.0
BACKOFF_MAX_S = 30.0
MAX_CRASH_RESTARTS = 5
MAX_PREEMPTION_RESTARTS = None
# > 0: a reset after 0 s would forgive every crash at once (a deterministic failure then
# restarts forever at the first backoff). The default is Kubernetes' 10 minutes.
RESET_AFTER_S = 600.0
CRASH_LOOP_AFTER = 3
CRASH_LOOP_WINDOW_STEPS = 16
