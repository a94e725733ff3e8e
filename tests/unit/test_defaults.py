"""One set of defaults: a core built by hand (``SyncerSettings()``, ``FleetSettings(regions)``,
``RegionPlan(n, n)``, ``RestartPolicy()``) decides as the service built from a default job config
does (``build.syncer_settings`` / ``fleet_settings`` / ``restart_policy``), field by field.

A field the job config does not set is named below with why; a new field must be compared or
named, so a default cannot drift apart again unnoticed."""

import dataclasses

from islands import defaults
from islands.orchestrator import build
from islands.orchestrator.config import JobConfig
from islands.orchestrator.fleet import FleetSettings, RegionPlan
from islands.orchestrator.health import RestartPolicy
from islands.syncer.core import SyncerSettings

# Fields of the cores the job config has no default for.
SYNCER_NOT_IN_CONFIG = {
    "norm_window": "the outlier window's length, not a setting",
    "quarantine_after": "not a setting",
    "inner_schedule": "from the learner's inner optimizer (None: drift norms per step)",
    "tokens_per_step": "from the task's batch (None: not checked)",
}
FLEET_NOT_IN_CONFIG = {
    "regions": "no default: the regions are the job's",
    "startup_timeout_s": "not a setting",
    "restart_retry_s": "not a setting",
    "first_shard": "a region agent's fleet only",
    "num_shards": "a region agent's fleet only",
    "policy": "compared on its own (RestartPolicy)",
}
REGION_NOT_IN_CONFIG = {
    "learners": "no default",
    "max_learners": "no default",
    "speed_factors": "built per learner",
    "names": "not a setting",
}


def compared(cls, not_in_config) -> list[str]:
    names = [f.name for f in dataclasses.fields(cls)]
    assert set(not_in_config) <= set(names), set(not_in_config) - set(names)
    return [name for name in names if name not in not_in_config]


def differences(core, built, names) -> dict:
    return {name: (getattr(core, name), getattr(built, name)) for name in names
            if getattr(core, name) != getattr(built, name)}


def test_the_syncer_cores_defaults_are_the_job_configs():
    built = build.syncer_settings(JobConfig.model_validate({}))
    names = compared(SyncerSettings, SYNCER_NOT_IN_CONFIG)
    assert len(names) == 15
    assert differences(SyncerSettings(), built, names) == {}
    # the four asynchrony rules, by name (they were pull / per_merge / learner / 0 in the core)
    core = SyncerSettings()
    assert (core.outer_gradient.value, core.round_step.value, core.schedule_clock.value,
            core.round_wait) == ("rebased", "per_round", "fleet", 0.5)


def test_the_fleet_cores_defaults_are_the_job_configs():
    config = JobConfig.model_validate({"regions": {"a": {"learners": 2}}})
    built = build.fleet_settings(config)
    core = FleetSettings(regions=built.regions)
    names = compared(FleetSettings, FLEET_NOT_IN_CONFIG)
    assert {"spare_wait_s", "drain_timeout_s", "heartbeat_timeout_s"} <= set(names)
    assert differences(core, built, names) == {}
    plan = RegionPlan(2, 2)
    assert differences(plan, built.regions["a"], compared(RegionPlan, REGION_NOT_IN_CONFIG)) == {}
    assert (core.spare_wait_s, plan.prestart) == (10.0, True)
    # the drain deadline follows the heartbeat timeout as build derives it
    assert core.drain_timeout_s == defaults.DRAIN_TIMEOUT_FACTOR * core.heartbeat_timeout_s


def test_the_restart_policys_defaults_are_the_job_configs():
    built = build.restart_policy(JobConfig.model_validate({}))
    names = compared(RestartPolicy, {})
    assert names == list(JobConfig.model_validate({}).health.restart.model_dump())
    assert differences(RestartPolicy(), built, names) == {}
