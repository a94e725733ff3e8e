"""Synchronous data-parallel baseline: the exact all-reduce step, the failure timeline worked by
hand (stop everyone, wait, roll back to the checkpoint), and its bytes and goodput (docs/architecture.md#goodput)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import assert_trees_close
from islands.orchestrator import inprocess
from islands.studies import baseline
from islands.orchestrator.chaos import FaultPlan, RestartCosts

M = 3
LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.95, 1e-8, 0.1
ADAMW = optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)


def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    return {"w": jax.random.normal(k1, (4, 3)), "b": jax.random.normal(k2, (3,)) * 0.1}


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w"] + params["b"][None, :]) - y) ** 2)


def batch_for(learner, step):
    rng = np.random.default_rng((learner, step))
    x = rng.normal(size=(8, 4)).astype(np.float32)
    return x, np.cos(x[:, :3] + learner).astype(np.float32)


def reference_adamw(params, steps):
    """AdamW written out: g = (1/M) Σ_m ∇L(θ; batch_m); m ← β1 m + (1−β1) g; v ← β2 v + (1−β2) g²;
    θ ← θ − lr (m̂ / (√v̂ + ε) + wd θ), with m̂ = m/(1−β1ᵗ), v̂ = v/(1−β2ᵗ)."""
    theta = {k: np.asarray(v, np.float64) for k, v in params.items()}
    mom = {k: np.zeros_like(v) for k, v in theta.items()}
    vel = {k: np.zeros_like(v) for k, v in theta.items()}
    grad = jax.grad(loss_fn)
    for t in range(1, steps + 1):
        grads = [grad({k: jnp.asarray(v, jnp.float32) for k, v in theta.items()},
                      batch_for(m, t - 1)) for m in range(M)]
        for k in theta:
            g = sum(np.asarray(gm[k], np.float64) for gm in grads) / M
            mom[k] = B1 * mom[k] + (1 - B1) * g
            vel[k] = B2 * vel[k] + (1 - B2) * g * g
            m_hat, v_hat = mom[k] / (1 - B1 ** t), vel[k] / (1 - B2 ** t)
            theta[k] = theta[k] - LR * (m_hat / (np.sqrt(v_hat) + EPS) + WD * theta[k])
    return theta


def run(steps, plan=None, **kwargs):
    return baseline.run_baseline(
        params=init_params(), optimizer=ADAMW, loss_fn=loss_fn, batch_for=batch_for,
        tokens_per_batch=8, fleet=inprocess.Fleet([1.0] * M),
        learner_ids=[f"r:{i}" for i in range(M)],
        steps=steps, faults=plan, **kwargs)


def test_one_step_is_adamw_on_the_averaged_gradient():
    record = run(1)
    ref = reference_adamw(init_params(), 1)
    assert_trees_close(record.params, {k: v.astype(np.float32) for k, v in ref.items()},
                       atol=1e-6, rtol=1e-6)
    three = run(3)
    ref3 = reference_adamw(init_params(), 3)
    assert_trees_close(three.params, {k: v.astype(np.float32) for k, v in ref3.items()},
                       atol=1e-6, rtol=1e-5)


def test_ring_allreduce_bytes_and_time():
    """M = 4, 1000 params: each learner sends 2·3/4·4·1000 = 6000 bytes. At 12 000 bytes/s and
    10 ms latency the all-reduce takes 2·3·0.01 + 0.5 = 0.56 s, so a 1 s step lasts 1.56 s."""
    assert baseline.ring_allreduce_bytes(1000, 4) == 6000.0
    assert baseline.ring_allreduce_bytes(1000, 1) == 0.0
    fleet = inprocess.Fleet([1.0, 1.0, 0.5, 1.0], latency_s=0.01, bandwidth_bytes_per_s=12_000.0)
    timeline = baseline.simulate_timeline(learner_ids=[f"r:{i}" for i in range(4)], fleet=fleet,
                                          num_params=1000, checkpoint_every_steps=5, steps=10)
    # the slowest learner (speed 0.5) takes 2 s: steps last 2.56 s
    assert [a.end_s - a.start_s for a in timeline.attempts] == pytest.approx([2.56] * 10)
    assert timeline.wire_bytes == 10 * 4 * 6000.0
    assert timeline.goodput == pytest.approx(1.0)


def test_goodput_of_one_scripted_failure_by_hand():
    """2 learners, 1 s steps, no all-reduce time, checkpoint every 4 steps, 10 steps. r:0 dies at
    6.5 s during step 7; repair 2 s + restart 1 s: everyone waits until 9.5 s, then rolls back to
    the checkpoint of step 4 and trains steps 5..10 on [9.5, 15.5). Kept: steps 1–4 and the
    second 5–10, 10 s; lost: steps 5, 6 (2 s), half of step 7 (0.5 s) and the wait (3 s).
    Goodput = 10 / 15.5 = 0.645."""
    plan = FaultPlan().crash("r:0", at_s=6.5, repair_s=2.0)
    timeline = baseline.simulate_timeline(learner_ids=["r:0", "r:1"],
                                          fleet=inprocess.Fleet([1.0, 1.0]), num_params=10,
                                          checkpoint_every_steps=4, steps=10, faults=plan,
                                          restart=RestartCosts(restart_s=1.0))
    assert timeline.goodput == pytest.approx(10 / 15.5)
    assert timeline.end_s == 15.5 and timeline.final_step == 10
    assert timeline.outages == [(6.5, 9.5, ("r:0",))]
    assert timeline.rollbacks == [(9.5, 6, 4)]
    assert [(a.step, a.start_s, a.completed, a.kept) for a in timeline.attempts[4:8]] == [
        (5, 4.0, True, False), (6, 5.0, True, False), (7, 6.0, False, False), (5, 9.5, True, True)]
    assert timeline.completed_steps == 12 and plan.fired == plan.faults
    _, windowed, cumulative = timeline.goodput_series(5.0)
    # [0,5): steps 1–4 kept, 5 rolled back → 0.8; [5,10): 0.5 s of the second step 5 → 0.1
    assert windowed[:2].tolist() == pytest.approx([0.8, 0.1])
    assert cumulative[-1] == pytest.approx(10 / 15.5)


def test_losses_during_an_outage_extend_it_and_a_down_learner_is_not_hit_twice():
    """r:0 dies at 2.5 (back at 2.5 + 4 = 6.5); r:1 dies at 4.0 while everyone waits (back at 8);
    r:0 is hit again at 5.0 while still down: skipped. Resume at 8 from the checkpoint of step 2."""
    plan = (FaultPlan().crash("r:0", at_s=2.5, repair_s=3.0).crash("r:1", at_s=4.0, repair_s=3.0)
            .crash("r:0", at_s=5.0, repair_s=3.0))
    timeline = baseline.simulate_timeline(learner_ids=["r:0", "r:1"],
                                          fleet=inprocess.Fleet([1.0, 1.0]), num_params=10,
                                          checkpoint_every_steps=2, steps=6, faults=plan,
                                          restart=RestartCosts(restart_s=1.0))
    assert timeline.outages == [(2.5, 8.0, ("r:0", "r:1"))]
    assert [why for _, why in timeline.faults_skipped] == ["r:0 is already down"]
    # kept: steps 1, 2 and 3–6 after 8 s → 6 s of 12
    assert timeline.end_s == 12.0 and timeline.goodput == pytest.approx(6 / 12)


def test_a_failed_run_ends_with_the_no_failure_params_later():
    """Rolled-back steps recompute identically, so the final model equals the clean run's; only the
    clock differs."""
    clean = run(8, checkpoint_every_steps=3)
    plan = FaultPlan().crash("r:2", at_s=5.5, repair_s=1.0).lose_region("r", at_s=9.2,
                                                                      repair_s=0.0)
    failed = run(8, plan, checkpoint_every_steps=3, restart=RestartCosts(restart_s=0.5),
                 evaluate=lambda p: float(loss_fn(p, batch_for(0, 99))), eval_every_steps=4)
    assert_trees_close(failed.params, clean.params, atol=0, rtol=0)
    assert failed.timeline.end_s > clean.timeline.end_s == 8.0
    assert failed.timeline.completed_steps > 8 and failed.wire_bytes > clean.wire_bytes
    assert [step for step in failed.eval_steps] == [0, 4, 8]
    times = [t for t, _, _ in failed.evals]
    assert times[0] == 0.0 and times[-1] == failed.timeline.end_s and times == sorted(times)
    assert failed.tokens == 8 * M * 8
