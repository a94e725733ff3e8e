"""The in-process driver's records on five seeded fault runs are pinned: transitions, step logs,
restarts, books, merges and final parameters, each as a digest in ``inprocess_records.json``.

A change to how the driver is put together (its owner, its groups, its handlers) must leave
every record as it was; a change that means to alter what a run does regenerates the fixture
(``ISLANDS_WRITE_RECORDS=1 pytest tests/unit/test_inprocess_records.py``) and says why in its
commit. Tiny runs (a 4x8 model, tens of virtual seconds): the whole file takes seconds.
"""

import hashlib
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from islands.orchestrator import chaos, inprocess
from islands.orchestrator import fleet as F
from islands.orchestrator.chaos import FaultPlan, RestartCosts
from islands.syncer import codec as codec_lib
from islands.syncer import fragments, merge, outer
from islands.syncer.core import SyncerSettings

FIXTURE = pathlib.Path(__file__).with_name("inprocess_records.json")
INNER = optax.adam(3e-2)
from tiny_task import TOKENS, batch_for  # noqa: E402  (the shared tiny task)
PARTS = ("transitions", "step_log", "restarts", "books", "merges", "params", "other")


def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (4, 8)) * 0.5, "w2": jax.random.normal(k2, (8, 2)) * 0.5,
            "bias": jnp.zeros(2), "scale": jnp.ones(8)}


@jax.jit
def train_step(params, opt_state, batch):
    def loss_fn(p):
        x, y = batch
        h = jnp.tanh(x @ p["w1"]) * p["scale"][None, :]
        return jnp.mean((h @ p["w2"] + p["bias"][None, :] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = INNER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def run(*, ids, plan=None, commands=(), P=2, H=2, tau=1, steps=20, latency_s=0.2,
        until_s=None, spares=0, restart_wait_s=0.0, carry_overlap=True, **costs):
    params = init_params()
    codec = codec_lib.make_codec("none")
    syncer, learners = inprocess.build_syncer_and_learners(
        params=params, opt_init=INNER.init, plan=fragments.partition(params, P),
        settings=SyncerSettings(min_learners=1, grace_cap_s=0.0, overlap_steps=tau,
                                merge_rule=merge.MergeRule.MEAN, outlier_norm_factor=None),
        outer_optimizer=outer.build("sgd", lr=1.0, momentum=0.0),
        error_feedback_factory=lambda: codec_lib.error_feedback(codec),
        decode=lambda c: codec_lib.decode_tree(codec, c), wire_bytes=codec_lib.tree_wire_bytes,
        learner_ids=ids, merge_alpha=0.0, carry_overlap=carry_overlap)
    costs = {"restart_s": 1.5, "promote_s": 0.3, "spare_ready_s": 2.0, "syncer_restart_s": 1.0,
             "detect_hang_s": 1.0, **costs}
    return inprocess.run_inprocess(
        learners=learners, syncer=syncer, train_step=train_step, batch_for=batch_for,
        tokens_per_batch=TOKENS,
        fleet=inprocess.Fleet([1.0 + 0.25 * (i % 3) for i in range(len(ids))],
                              latency_s=latency_s, step_noise=0.1, seed=5, spares=spares,
                              restart_wait_s=restart_wait_s),
        num_fragments=P, sync_every_steps=H, steps=steps, faults=plan,
        restart=RestartCosts(**costs), opt_init=INNER.init, until_s=until_s,
        assemble=inprocess.assemble_like(params), commands=commands)


TWO_REGIONS = {"a": ["a:0", "a:1"], "b": ["b:0", "b:1"]}


def poisson(seed, **kwargs):
    return chaos.poisson_plan(TWO_REGIONS, 30.0, seed=seed, **kwargs)


RUNS = {
    # Poisson kills, region losses, slowdowns, network faults and syncer kills; one warm spare.
    "poisson_mix_spares": lambda: run(
        ids=[x for xs in TWO_REGIONS.values() for x in xs], steps=24, until_s=40.0, spares=1,
        plan=poisson(3, mtbf_s=12.0, repair_s=1.0, region_mtbf_s=40.0, slowdown_mtbf_s=15.0,
                     network_mtbf_s=15.0, syncer_mtbf_s=25.0, network_s=3.0, slowdown_s=3.0)),
    # Hard exits with a backoff, starts sharing one core, survivors slowed by starts.
    "exits_shared_starts": lambda: run(
        ids=[x for xs in TWO_REGIONS.values() for x in xs], steps=20, restart_wait_s=0.5,
        plan=poisson(8, mtbf_s=8.0, repair_s=0.5, kill_mode="exit"), start_cpu_s=1.0,
        start_cores=1.0, survivor_slowdown_per_start=0.25),
    # A hang found by the timeout, a kill during a restart, a partition and a slow learner.
    "hang_kill_partition": lambda: run(
        ids=["r:0", "r:1", "r:2"], steps=18, tau=2, H=4,
        plan=(FaultPlan().hang("r:1", at_s=3.5, duration_s=30.0).crash("r:1", at_s=5.0)
              .crash("r:0", at_s=9.2, repair_s=1.0).partition("r", at_s=11.0, duration_s=2.0)
              .slow("r:2", at_s=2.0, duration_s=4.0, factor=2.5))),
    # A syncer kill with a drain while it is down, a pause and a resume, a refused command.
    "syncer_drain_pause": lambda: run(
        ids=["r:0", "r:1", "r:2"], steps=16,
        plan=FaultPlan().kill_syncer(at_s=5.2).crash("r:0", at_s=8.0),
        commands=[(5.5, F.Drain("r:2")), (9.0, F.PauseJob(True, "operator")),
                  (11.0, F.PauseJob(False, "operator")), (12.0, F.Drain("r:9"))]),
    # A scale-down and a drain past its deadline, spares replacing killed learners.
    "scale_spares_kills": lambda: run(
        ids=["a:0", "a:1", "a:2", "b:0"], steps=20, spares=1, until_s=30.0,
        plan=(FaultPlan().crash("a:1", at_s=3.0).crash("b:0", at_s=4.1, mode="exit")
              .crash("a:1", at_s=9.0).lose_region("b", at_s=12.0, repair_s=1.0)),
        commands=[(6.0, F.Scale("a", 2)), (14.0, F.Drain("b:0"))]),
}


def canon(value):
    """JSON-able, deterministic, floats to 9 decimals (virtual times) so that a reordered sum
    of the same terms is not a difference."""
    if isinstance(value, float):
        return round(value, 9)
    if isinstance(value, dict):
        return {str(k): canon(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [canon(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return round(float(value), 9)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return repr(value)


def params_digest(tree) -> list:
    """Every leaf rounded to 1e-6 (exact bits differ across CPUs' XLA kernels; a real change
    in what a run trains moves them far more)."""
    leaves = jax.tree_util.tree_leaves(tree)
    return [np.round(np.asarray(x, np.float64), 6).ravel().tolist() for x in leaves]


def parts(record) -> dict:
    return {
        "transitions": [(t, x.name, x.learner, dict(x.fields)) for t, x in record.transitions],
        "step_log": [(s.learner, s.incarnation, s.step, s.start_s, s.step_s)
                     for s in record.step_log],
        "restarts": record.restarts,
        "books": {"ledger": record.ledger, "allocated_s": record.allocated_s,
                  "useful_s": record.useful_s, "down": record.down_intervals,
                  "watermarks": sorted(record.watermarks.items()),
                  "dropped_pushes": record.dropped_pushes},
        "merges": [(m.fragment, m.version, m.learners, m.staleness, m.reason, m.refused,
                    m.fleet_step, m.live) for m in record.merges],
        "params": {"global": params_digest(record.global_params),
                   "learners": [params_digest(p) for p in record.learner_params]},
        "other": {"steps": record.steps, "end": record.end_time_s,
                  "rejected": {str(k): v for k, v in record.rejected.items()},
                  "fired": [repr(f) for f in record.faults_fired],
                  "skipped": [(repr(f), why) for f, why in record.faults_skipped],
                  "refused": [(t, repr(c), why) for t, c, why in record.commands_refused],
                  "wire": (record.wire_bytes_up, record.wire_bytes_down,
                           record.wire_bytes_restore, record.tokens_processed)},
    }


PARAMS_TOLERANCE = 1e-5   # float32 training: another CPU's XLA kernels round differently


def digests(record) -> dict:
    out = {}
    for name, value in parts(record).items():
        if name == "params":   # values, compared within a tolerance (not bits: not a hash)
            out[name] = canon(value)
            continue
        text = json.dumps(canon(value), sort_keys=True)
        out[name] = hashlib.sha256(text.encode()).hexdigest()[:16]
    out["counts"] = {"transitions": len(record.transitions), "steps": len(record.step_log),
                     "restarts": len(record.restarts), "merges": len(record.merges),
                     "faults_fired": len(record.faults_fired)}
    return out


@pytest.fixture(scope="module")
def pinned():
    if os.environ.get("ISLANDS_WRITE_RECORDS"):
        FIXTURE.write_text(json.dumps({name: digests(make()) for name, make in RUNS.items()},
                                      indent=1, sort_keys=True) + "\n")
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("name", list(RUNS))
def test_the_in_process_records_are_what_they_were(name, pinned):
    got = digests(RUNS[name]())
    want = pinned[name]
    assert got["counts"] == want["counts"]
    hashed = [p for p in PARTS if p != "params"]
    assert {p: got[p] for p in hashed} == {p: want[p] for p in hashed}
    for kind in ("global", "learners"):
        a, b = np.concatenate(flat(got["params"][kind])), np.concatenate(flat(want["params"][kind]))
        assert a.shape == b.shape, kind
        worst = float(np.max(np.abs(a - b)))
        assert worst <= PARAMS_TOLERANCE, f"{kind} parameters moved by up to {worst:.3g}"


def flat(tree) -> list:
    """The leaves of a nested list of floats, as 1-D arrays."""
    if tree and isinstance(tree[0], (int, float)):
        return [np.asarray(tree, np.float64)]
    return [x for sub in tree for x in flat(sub)] or [np.zeros(0)]


def test_the_runs_meet_what_they_are_for(pinned):
    """The pinned runs exercise restarts, spares, the syncer's restart, drains, pauses and
    refused commands: a fixture of runs where nothing happens would pin nothing."""
    counts = {name: pinned[name]["counts"] for name in RUNS}
    assert all(c["restarts"] >= 2 and c["merges"] > 20 for n, c in counts.items()
               if n != "syncer_drain_pause")
    assert counts["syncer_drain_pause"]["restarts"] >= 1
    assert all(c["faults_fired"] >= 2 for c in counts.values())
