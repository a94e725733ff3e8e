"""Restart policy (budgets 0, 1, 10; backoff schedule) and failure detection, with hand-worked values."""

import pytest

from islands.orchestrator.fleet import recovery_phases
from islands.orchestrator.health import Cause, RestartDecision, RestartPolicy, detect


def run_failures(policy, causes):
    restarts = {}
    verdicts = []
    for cause in causes:
        verdict = policy.decide("us-east:2", cause, restarts)
        verdicts.append(verdict)
        if verdict.decision == RestartDecision.RESTART:
            restarts[cause] = restarts.get(cause, 0) + 1
    return verdicts


@pytest.mark.parametrize("budget,restarted", [(0, 0), (1, 1), (10, 10)])
def test_crash_budget(budget, restarted):
    policy = RestartPolicy(max_crash_restarts=budget)
    verdicts = run_failures(policy, [Cause.CRASH] * 12)
    decisions = [v.decision for v in verdicts]
    assert decisions[:restarted] == [RestartDecision.RESTART] * restarted
    assert decisions[restarted] == RestartDecision.RETIRE
    assert f"budget of {budget} spent" in verdicts[restarted].message


def test_backoff_first_and_last_step():
    # delay = min(0.5·2ⁿ, 30) with n = restarts so far: 0.5, 1, 2, 4, 8, 16, 30, 30
    policy = RestartPolicy(max_crash_restarts=None)
    delays = [v.delay_s for v in run_failures(policy, [Cause.CRASH] * 8)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_preemption_has_its_own_budget():
    policy = RestartPolicy(max_crash_restarts=1, max_preemption_restarts=2)
    verdicts = run_failures(policy, [Cause.PREEMPTION, Cause.CRASH, Cause.PREEMPTION,
                                     Cause.PREEMPTION, Cause.HANG])
    assert [v.decision.value for v in verdicts] == ["restart", "restart", "restart", "retire",
                                                    "retire"]
    # The backoff counts crashes only: the preemption before the crash does not lengthen it.
    assert verdicts[1].message == "restart 1 of 1 (crash) us-east:2 in 0.50s"
    assert verdicts[2].message == "restart 2 of 2 (preemption) us-east:2 in 1.00s"


def test_detect_hang_straggler_and_startup():
    peers = [1.0, 1.1, 0.9]
    assert detect(100.0, 95.0, 0.0, 1.0, peers, 10.0, 4.0) is None
    assert detect(100.0, 89.0, 0.0, 1.0, peers, 10.0, 4.0) == Cause.HANG
    assert detect(100.0, 99.0, 0.0, 4.5, peers, 10.0, 4.0) == Cause.STRAGGLER  # 4.5 > 4 × 1.0
    assert detect(100.0, 99.0, 0.0, 3.9, peers, 10.0, 4.0) is None
    assert detect(100.0, 99.0, 0.0, 50.0, [1.0], 10.0, 4.0) is None  # no median of one
    # Before the first heartbeat a learner is starting (JAX import, compile): startup timeout.
    assert detect(100.0, None, 50.0, None, peers, 10.0, 4.0, startup_timeout_s=60) is None
    assert detect(100.0, None, 30.0, None, peers, 10.0, 4.0, startup_timeout_s=60) == Cause.HANG


def test_recovery_phases():
    rec = {"cause": "crash", "failed_s": 10.0, "detected_s": 10.5, "restarted_s": 11.0,
           "restore_done_s": 14.0, "first_contribution_s": 15.5}
    assert recovery_phases(rec) == {"cause": "crash", "detect_s": 0.5, "restart_s": 0.5,
                                    "restore_s": 3.0, "first_contribution_s": 1.5,
                                    "total_s": 5.5}


def test_death_cause_node_gone_or_said_so():
    from islands.orchestrator.health import death_cause

    assert death_cause("n1", {"n1", "n2"}) == Cause.CRASH
    assert death_cause("n1", {"n2"}) == Cause.PREEMPTION       # its node left the cluster
    assert death_cause(None, {"n2"}) == Cause.CRASH            # never heartbeat: no evidence
    # Ray reported the actor's death before the node's.
    assert death_cause("n1", {"n1"}, error_text="The actor died because its node has died.") \
        == Cause.PREEMPTION
    assert death_cause("n1", {"n1"}, preempted=True) == Cause.PREEMPTION  # autoscaler drain
    # A worker process that exited on a live node is a crash, whatever the text mentions.
    assert death_cause("n1", {"n1"}, error_text="The actor died unexpectedly before finishing "
                       "this task. ip: 127.0.0.1 Worker unexpectedly exits; the node is "
                       "alive") == Cause.CRASH


def test_grown_target_first_and_last_step():
    from islands.orchestrator.health import grown_target

    assert grown_target(2, None, 2, 4) is None   # the first look only records the capacity
    assert grown_target(3, 2, 2, 4) == 3         # one node with region:<name> 1 joined
    assert grown_target(9, 3, 3, 4) == 4         # capped at max_learners
    assert grown_target(5, 4, 4, 4) is None      # at the cap already
    assert grown_target(1, 2, 2, 4) is None      # shrinking is handled as preemption, not here


def test_being_slow_never_spends_the_crash_budget():
    policy = RestartPolicy(backoff_initial_s=1.0, backoff_multiplier=2.0, backoff_max_s=30.0,
                           max_crash_restarts=1)
    # Three straggler restarts so far: the crash budget of 1 is still whole.
    history = {Cause.STRAGGLER: 3}
    crash = policy.decide("a:0", Cause.CRASH, history)
    assert crash.decision == RestartDecision.RESTART and crash.attempt == 1
    assert crash.delay_s == 1.0                   # the backoff counts crashes only: 1 · 2^0
    slow = policy.decide("a:0", Cause.STRAGGLER, {Cause.CRASH: 1, Cause.STRAGGLER: 3})
    assert slow.decision == RestartDecision.RESTART and slow.budget is None
    assert slow.message == "restart 4 of unlimited (straggler) a:0 in 2.00s"
