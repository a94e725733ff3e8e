"""A planned preemption on a real multi-node local Ray cluster: the node of region b is drained as
a platform announces a preemption (``islands drain-node``: Ray's drain with a deadline); its
learners finish their in-flight pushes, leave, and restart at once on another node under the
cause ``preempted_planned``; nothing crashes, and the node leaves once idle. Every wait is on real
state with a timeout. Run it with ``-m slow``.
"""

import pytest

ray = pytest.importorskip("ray")

from conftest import TINY_JOB  # noqa: E402
from islands.orchestrator.config import JobConfig  # noqa: E402
from islands.orchestrator.controller import (NAMESPACE, Controller,  # noqa: E402
                                             controller_options)
from waiting import wait_for  # noqa: E402  (tests/integration/waiting.py)

# A three-node cluster and a job that starts three learners: about two minutes on 2 cores.
pytestmark = [pytest.mark.ray, pytest.mark.slow]

JOB = {**TINY_JOB, "name": "preempt",
       "regions": {"a": {"learners": 1}, "b": {"learners": 2, "max_learners": 2}},
       "health": {"heartbeat_s": 0.5, "timeout_s": 8.0}}


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    # The head runs the controller, the syncer and region a; region b's node is added after it.
    nodes = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, resources={"region:a": 1}, include_dashboard=False,
        node_ip_address="127.0.0.1"))
    try:
        b = nodes.add_node(num_cpus=1, resources={"region:b": 2}, node_ip_address="127.0.0.1")
        ray.init(address=nodes.address, namespace=NAMESPACE, log_to_driver=False)
        nodes.wait_for_nodes()
        yield nodes, b
    finally:
        ray.shutdown()
        nodes.shutdown()


def test_a_drained_node_hands_its_learners_over_to_another_node(cluster, tmp_path):
    nodes, node_b = cluster
    config = JobConfig.model_validate(JOB)
    controller = ray.remote(Controller).options(**controller_options(str(tmp_path))).remote(
        config, str(tmp_path))
    ray.get(controller.start.remote())
    snap = lambda: ray.get(controller.snapshot.remote())  # noqa: E731

    def events(kind=None):
        found, _ = ray.get(controller.events_since.remote(0))
        return [e for e in found if kind is None or e["event"] == kind]

    try:
        learners = lambda: snap()["learners"]  # noqa: E731
        wait_for(lambda: snap()["learner_states"].get("training") == 3, 240, "3 learners training",
                 describe=learners)
        wait_for(lambda: (snap()["syncer"]["merges"] or 0) >= 2, 60, "first merges")
        assert {learners()[n]["node"] for n in ("b:0", "b:1")} == {node_b.node_id}
        # Ray cannot undo a drain: the head node, and region b's only node, are refused before
        # Ray is asked (nothing drains).
        for node, why in ((nodes.head_node.node_id, "is the head node"),
                          (node_b.node_id, "is the last node where region 'b''s learners can run")):
            with pytest.raises(ray.exceptions.RayTaskError, match=why):
                ray.get(controller.drain_node.remote(node, 60.0))
        assert not ray._private.state.state.get_draining_nodes()
        # Where region b can go on: a node that joins (max_learners keeps the fleet at 2 there).
        node_c = nodes.add_node(num_cpus=1, resources={"region:b": 2},
                                node_ip_address="127.0.0.1")
        nodes.wait_for_nodes()

        print(ray.get(controller.drain_node.remote(node_b.node_id, 60.0)))
        moved = lambda: all(  # noqa: E731
            learners()[n]["incarnation"] == 1 and learners()[n]["state"] == "training"
            and learners()[n]["node"] == node_c.node_id for n in ("b:0", "b:1"))
        wait_for(moved, 120, "b:0 and b:1 training on the joined node", describe=learners)
        # Their replacements contribute (a merged push of the new incarnation closes the
        # recovery, under the planned cause).
        planned = lambda: [r for r in snap()["recoveries"]  # noqa: E731
                           if r["cause"] == "preempted_planned"]
        wait_for(lambda: len(planned()) == 2, 60, "both replacements' first merged pushes",
                 describe=lambda: snap()["recoveries"])
        # The drained node leaves once nothing runs there any more.
        wait_for(lambda: not any(n["Alive"] for n in ray.nodes()
                                 if n["NodeID"] == node_b.node_id), 60, "node b gone")

        (notice,) = events("node_draining")
        assert notice["node"] == node_b.node_id and sorted(notice["learners"]) == ["b:0", "b:1"]
        assert 0 < notice["deadline_in_s"] <= 60
        draining = events("learner_draining")
        assert sorted(e["learner"] for e in draining) == ["b:0", "b:1"]
        assert {e["cause"] for e in draining} == {"preempted_planned"}
        scheduled = events("learner_restart_scheduled")
        assert sorted((e["learner"], e["cause"]) for e in scheduled) == [
            ("b:0", "preempted_planned"), ("b:1", "preempted_planned")]
        # Nothing crashed, failed or was refused on the way.
        assert not events("learner_failed") and not events("learner_error"), events()
        refused = [e for e in events("push_refused") if e.get("learner", "").startswith("b:")
                   and e.get("incarnation") == 0]
        assert not refused, refused
        s = snap()
        assert s["learner_restarts"] == {"preempted_planned": 2}   # restarts_total{reason}
        # The books: the drained incarnations dropped only the steps after their fragments' last
        # pushes (the drain lets the in-flight pushes finish; measured 5.5 steps a learner once,
        # bounded here by two sync intervals).
        tokens = s["tokens"]
        per_learner = (2 * (JOB["syncer"]["sync_every_steps"] + JOB["syncer"]["overlap_steps"])
                       * JOB["data"]["batch_size"] * JOB["model"]["seq_len"])
        assert tokens["dropped_by"].get("drained", 0.0) <= 2 * per_learner, tokens
        assert set(tokens["dropped_by"]) <= {"drained", "overlap"}, tokens
        assert tokens["balanced"], tokens
    finally:
        ray.get(controller.shutdown.remote(), timeout=120)
        ray.kill(controller)
