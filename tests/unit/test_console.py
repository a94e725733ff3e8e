"""The console's pure parts: where its token comes from, the action checks, the goodput series."""

import os
import stat

import pytest

from islands.orchestrator.console import (ActionError, goodput_series, plan_action,
                                          resolve_token)


def test_token_order_file_then_env_then_rays_then_generated(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("from-file\n")
    ray_token = tmp_path / "ray_token"
    ray_token.write_text("ray-token")
    env = {"ISLANDS_CONSOLE_TOKEN": "from-env", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(ray_token)}
    run = str(tmp_path / "run")
    assert resolve_token(str(secret), run, env) == ("from-file", str(secret))
    assert resolve_token(None, run, env)[0] == "from-env"
    del env["ISLANDS_CONSOLE_TOKEN"]
    assert resolve_token(None, run, env)[0] == "ray-token"
    assert resolve_token(None, run, {**env, "RAY_AUTH_TOKEN": "ray-env"})[0] == "ray-env"
    assert not os.path.exists(run)   # nothing generated while a token was found
    token, where = resolve_token(None, run, {})   # Ray's auth off: its file is not used
    assert where == os.path.join(run, "console_token") and len(token) >= 32
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o600
    assert resolve_token(None, run, {}) == (token, where)   # a resumed run keeps it


def test_an_unreadable_or_empty_token_file_is_an_error_naming_it(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match=f"console.token_file {empty} is empty"):
        resolve_token(str(empty), str(tmp_path), {})
    with pytest.raises(ValueError, match="console.token_file /no/such/file: cannot read it"):
        resolve_token("/no/such/file", str(tmp_path), {})


@pytest.mark.parametrize("body, error", [
    ([], ActionError), ({"action": "reboot"}, ActionError),
    ({"action": "scale", "region": "a", "n": True}, ActionError),
    ({"action": "drain", "learner": ""}, ActionError),
    ({"action": "drain_node", "node_id": "n2", "deadline_s": -1}, ActionError),
    ({"action": "drain_node", "deadline_s": 5}, ActionError),
    ({"action": "chaos_hang", "learner": "a:0", "duration_s": 5}, PermissionError),
])
def test_bad_actions_are_refused_before_anything_runs(body, error):
    with pytest.raises(error):
        plan_action(body, False, "console 127.0.0.1")


def test_actions_call_the_clis_controller_methods():
    calls = []

    class Recorder:
        def __getattr__(self, name):
            return lambda *args: calls.append((name, args)) or "ok"

    for body in ({"action": "scale", "region": "a", "n": 2}, {"action": "drain", "learner": "a:1"},
                 {"action": "restart", "learner": "a:0"}, {"action": "pause"},
                 {"action": "resume"}, {"action": "drain_node", "node_id": "n2", "deadline_s": 30},
                 {"action": "drain_node", "node_id": "n3"}):
        plan_action(body, False, "console 10.0.0.9")[1](Recorder())
    for body in ({"action": "clear_misconfigured", "node_id": "n4"},
                 {"action": "clear_misconfigured"}):   # every marked node
        plan_action(body, False, "console 10.0.0.9")[1](Recorder())
    assert calls[-2:] == [("clear_misconfigured", ("n4", "console 10.0.0.9")),
                          ("clear_misconfigured", (None, "console 10.0.0.9"))]
    calls[-2:] = []
    assert calls == [("scale", ("a", 2)), ("drain", ("a:1",)), ("chaos_kill", ("a:0", "ray_kill")),
                     ("pause", (True, "console 10.0.0.9")), ("pause", (False, "console 10.0.0.9")),
                     ("drain_node", ("n2", 30.0, "console 10.0.0.9", False)),
                     ("drain_node", ("n3", None, "console 10.0.0.9", False))]


def test_the_goodput_series_spans_the_recent_past_with_its_window():
    history = [(float(t), 0.5 * t, float(t)) for t in range(0, 1001)]
    series = goodput_series(history, 1000.0, 600.0, 60.0, points=50)
    assert 40 <= len(series) <= 51 and series[-1][0] == 0 and series[0][0] == 600
    assert max(p[0] for p in series) <= 600
    assert all(p[1] == pytest.approx(0.5) and p[2] == pytest.approx(0.5) for p in series)


def test_the_page_state_comes_from_the_controllers_view_alone():
    """``console_state`` reads a plain view (``Controller.console_view``), never the controller:
    each learner row gains its beat's profiler, refusals and other events are split, NaN is null."""
    from islands.orchestrator.console import console_state

    snap = {"elapsed_s": 12.0, "paused_reason": None, "learners": {"a:0": {"step": 7},
                                                                   "a:1": {"step": 5}},
            "spares": {}, "syncer": {"merges": 3}, "syncer_restarts": 0,
            "goodput": float("nan"), "participation_counts": {}, "tokens": {},
            "train_loss": 2.0, "eval_loss": None}
    events = [{"event": "push_refused", "learner": "a:1"}, {"event": "merge", "fragment": 0}]
    view = {"snapshot": snap, "events": events, "profilers": {"a:0": {"step_s": 0.1}},
            "job": "demo", "goodput_window_s": 60.0, "goodput_history": [],
            "misconfigured": [{"node": "n1", "region": "gpu", "message": "device check failed",
                               "blocked": True}], "operator_paused": False,
            "regions": {"a": {"target": 2, "max_learners": 4, "remote": False}}}
    state = console_state(view, allow_chaos=False)
    assert state["job"] == "demo" and state["goodput"] is None
    assert state["learners"] == {"a:0": {"step": 7, "profiler": {"step_s": 0.1}},
                                 "a:1": {"step": 5, "profiler": None}}
    assert state["refusals"] == events[:1] and state["events"] == events[1:]
    assert state["regions"] == view["regions"] and state["misconfigured"] == view["misconfigured"]
