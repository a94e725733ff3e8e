"""`islands status` and `islands clear-misconfigured`: a node's device-check marks and a crash
loop, as an operator reads and clears them (no Ray: the table is the controller's answer)."""

import pytest

from islands.orchestrator import cli

LEARNER = {"region": "a", "state": "failed", "restarts": {"crash": 2}, "step": 50,
           "crash_loop": "failed 3 times at resume step 48 with: ValueError('bad record')"}


def test_status_names_each_marked_node_and_a_crash_loops_step_and_error():
    table = {"learners": {"a:0": LEARNER}, "syncer": {"epoch": 0, "merges": 0},
             "misconfigured": [{"node": "n1", "region": "gpu", "blocked": False,
                                "message": "device check failed: region gpu ..."}]}
    text = cli.format_status(table)
    assert "MISCONFIGURED region gpu on node n1: device check failed: region gpu ..." in text
    assert ("CRASH LOOP a:0: failed 3 times at resume step 48 with: ValueError('bad record')"
            in text)
    # An older controller's {region: message}.
    old = cli.format_status({**table, "misconfigured": {"gpu": "device check failed: x"}})
    assert "MISCONFIGURED region gpu: device check failed: x" in old


def test_status_names_failing_snapshots_with_their_error_and_count():
    syncer = {"epoch": 0, "merges": 9, "snapshot_failures": 3,
              "snapshot_error": "OSError: [Errno 28] No space left on device"}
    text = cli.format_status({"learners": {"a:0": LEARNER}, "syncer": syncer})
    assert "SNAPSHOTS FAILING (3 so far): OSError: [Errno 28] No space left on device" in text
    healthy = cli.format_status({"learners": {"a:0": LEARNER},
                                 "syncer": dict(syncer, snapshot_error=None)})
    assert "SNAPSHOTS" not in healthy


@pytest.mark.parametrize("argv", [["clear-misconfigured"],
                                  ["clear-misconfigured", "n1", "--all"]])
def test_clear_misconfigured_takes_a_node_or_all(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "node_id" in capsys.readouterr().err
