"""The operator console against a real local job: its actions over HTTP (token, refusals, events),
then in headless Chromium driven by Selenium: the page lists 4 learners in 2 regions, scaling a
region brings a third learner that turns to training on the page, a drain removes one, a pause
holds the job, and an action without the token is refused and changes nothing. Saves the page to
docs/console.png (with ISLANDS_UPDATE_SCREENSHOT=1). One cluster and one job for the module; every wait is on real state.
"""

import json
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from islands.orchestrator.config import JobConfig  # noqa: E402
from waiting import wait_for  # noqa: E402  (tests/integration/waiting.py)
from islands.orchestrator.controller import (NAMESPACE, Controller,  # noqa: E402
                                             controller_options)

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "console-test-token-5b1f"
JOB = {
    "name": "console",
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "seq_len": 32},
    "data": {"max_bytes": 300_000, "batch_size": 4, "eval_batches": 2},
    "learner": {"min_step_time_s": 0.05, "eval_every_s": 5.0},
    "syncer": {"fragments": 2, "sync_every_steps": 4, "overlap_steps": 1},
    "quorum": {"min_learners": 1, "grace_cap_s": 0.5},
    "regions": {"east": {"learners": 2, "max_learners": 3},
                "west": {"learners": 2, "max_learners": 3}},
    "health": {"heartbeat_s": 0.5, "timeout_s": 8.0},
    "metrics": {"enabled": False, "goodput_window_s": 30},
}


@pytest.fixture(scope="module")
def job(shared_ray, tmp_path_factory):
    config = JobConfig.model_validate(JOB)
    run_dir = tmp_path_factory.mktemp("run")
    controller = ray.remote(Controller).options(**controller_options(str(run_dir))).remote(
        config, str(run_dir))
    ray.get(controller.start.remote())
    port = ray.get(controller.serve_console.remote(0, "127.0.0.1", TOKEN, False))
    snap = lambda: ray.get(controller.snapshot.remote())  # noqa: E731
    wait_for(lambda: snap()["learner_states"].get("training") == 4, 240, "4 learners training",
             describe=lambda: snap()["learner_states"])
    yield controller, snap, f"http://127.0.0.1:{port}"
    ray.get(controller.shutdown.remote(), timeout=120)
    ray.kill(controller)


def post(url, body, token=None):
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url + "/api/action", data=json.dumps(body).encode(),
                                     headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def console_events(controller):
    found, _ = ray.get(controller.events_since.remote(0))
    return [e for e in found if e["event"] == "console_action"]


def test_the_state_is_strict_json_and_the_assets_are_local(job):
    controller, snap, url = job
    with urllib.request.urlopen(url + "/api/state", timeout=30) as r:
        state = json.loads(r.read(), parse_constant=lambda c: pytest.fail(f"{c} in the state"))
    assert sorted(state["regions"]) == ["east", "west"]
    assert sorted(state["learners"]) == ["east:0", "east:1", "west:0", "west:1"]
    assert set(state["goodput"]["badput_s"]) >= {"program_startup", "other"}
    with urllib.request.urlopen(url + "/", timeout=30) as r:
        page = r.read().decode()
        assert "default-src 'self'" in r.headers["Content-Security-Policy"]
    assert "http" not in page.replace('lang="en"', "")  # nothing fetched from elsewhere
    for asset in ("console.js", "console.css"):
        with urllib.request.urlopen(f"{url}/static/{asset}", timeout=30) as r:
            assert r.status == 200 and b"http://" not in r.read().replace(
                b"http://www.w3.org/2000/svg", b"")
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{url}/static/..%2Fconsole.py", timeout=30)
    assert missing.value.code == 404


def test_actions_without_or_with_a_wrong_token_or_chaos_off_are_refused_and_do_nothing(job):
    controller, snap, url = job
    before = snap()
    assert post(url, {"action": "scale", "region": "east", "n": 3}) == (
        401, {"ok": False, "error": "this action needs the console token"})
    status, reply = post(url, {"action": "drain", "learner": "west:1"}, token="guess")
    assert status == 403 and not reply["ok"]
    status, reply = post(url, {"action": "chaos_kill", "learner": "west:1"}, token=TOKEN)
    assert status == 403 and "allow_chaos" in reply["error"]
    status, reply = post(url, {"action": "scale", "region": "east", "n": "three"}, token=TOKEN)
    assert status == 400 and "'n' must be an integer" in reply["error"]
    status, reply = post(url, {"action": "scale", "region": "east", "n": 9}, token=TOKEN)
    assert status == 409 and "max_learners" in reply["error"]   # the fleet's own refusal
    after = snap()
    assert {n: (l["state"], l["incarnation"]) for n, l in after["learners"].items()} == {
        n: (l["state"], l["incarnation"]) for n, l in before["learners"].items()}
    refused = [e for e in console_events(controller) if e["result"] == "refused"]
    assert [e["status"] for e in refused] == [401, 403, 403, 400, 409]
    assert all(e["origin"] == "console" and e["client"] == "127.0.0.1" for e in refused)


def test_pause_and_resume_over_http_hold_and_release_every_learner(job):
    controller, snap, url = job
    assert post(url, {"action": "pause"}, token=TOKEN) == (200, {"ok": True,
                                                                 "message": "paused"})
    wait_for(lambda: snap()["learner_states"].get("paused") == 4, 30, "4 learners paused",
             describe=lambda: snap()["learner_states"])
    assert "operator" in snap()["paused_reason"]
    assert post(url, {"action": "pause"}, token=TOKEN)[0] == 409   # already paused
    assert post(url, {"action": "resume"}, token=TOKEN)[0] == 200
    wait_for(lambda: snap()["learner_states"].get("training") == 4, 30, "training again")
    done = [e for e in console_events(controller) if e["result"] == "done"]
    assert [e["action"] for e in done][-2:] == ["pause", "resume"]


# -- in a real browser ----------------------------------------------------------------------------
def _browser_paths():
    browser = next((p for p in (shutil.which(n) for n in (
        "chromium", "chromium-browser", "google-chrome", "google-chrome-stable")) if p), None)
    driver = shutil.which("chromedriver")
    return browser, driver


@pytest.fixture(scope="module")
def browser(job):
    path, driver_path = _browser_paths()
    if path is None or driver_path is None:
        pytest.skip("no headless browser for the console test: install chromium and "
                    "chromium-driver (apt-get install -y chromium chromium-driver); found "
                    f"browser={path}, chromedriver={driver_path}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = path
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1700"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    yield driver
    driver.quit()


def page_states(driver):
    from selenium.webdriver.common.by import By

    return {row.get_attribute("data-learner"): row.find_element(
        By.CSS_SELECTOR, ".state").get_attribute("data-state")
        for row in driver.find_elements(By.CSS_SELECTOR, "tr[data-learner]")}


def test_the_page_lists_learners_scales_drains_and_refuses_without_the_token(job, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    controller, snap, url = job
    driver = browser
    driver.get(url + "/")
    wait = WebDriverWait(driver, 60, poll_frequency=0.2)
    wait.until(lambda d: len(page_states(d)) == 4)
    regions = [r.get_attribute("data-region")
               for r in driver.find_elements(By.CSS_SELECTOR, "[data-region]")]
    assert regions == ["east", "west"]
    assert set(page_states(driver).values()) == {"training"}

    # Without the token: refused, shown, and nothing changes.
    field = driver.find_element(By.ID, "scale-n-east")
    field.clear()
    field.send_keys("3")
    driver.find_element(By.ID, "scale-east").click()
    wait.until(lambda d: d.find_element(By.ID, "result").get_attribute("data-status") == "401")
    assert "refused" in driver.find_element(By.ID, "result").text
    assert sorted(snap()["learners"]) == ["east:0", "east:1", "west:0", "west:1"]

    # With it: a third learner in east appears and turns to training on the page.
    driver.find_element(By.ID, "token").send_keys(TOKEN)
    field = driver.find_element(By.ID, "scale-n-east")
    field.clear()
    field.send_keys("3")
    driver.find_element(By.ID, "scale-east").click()
    wait.until(lambda d: d.find_element(By.ID, "result").get_attribute("data-status") == "200")
    WebDriverWait(driver, 240, poll_frequency=0.5).until(
        lambda d: page_states(d).get("east:2") == "training")
    assert snap()["learners"]["east:2"]["state"] == "training"
    wait.until(lambda d: d.find_element(By.ID, "goodput-run").text.endswith("%"))
    # The picture in the docs is refreshed on request only, so a test run leaves the tree clean.
    shot = (ROOT / "docs" / "console.png" if os.environ.get("ISLANDS_UPDATE_SCREENSHOT")
            else tmp_path / "console.png")
    driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000   # a real page, not an empty frame

    # Drain one: it leaves (retired) on the page and in the fleet.
    driver.find_element(By.CSS_SELECTOR, '[data-drain="west:1"]').click()
    WebDriverWait(driver, 120, poll_frequency=0.5).until(
        lambda d: page_states(d).get("west:1") == "retired")
    assert snap()["learners"]["west:1"]["state"] == "retired"
    done = [(e["action"], e.get("region") or e.get("learner"), e["client"])
            for e in console_events(controller) if e["result"] == "done"]
    assert ("scale", "east", "127.0.0.1") in done and ("drain", "west:1", "127.0.0.1") in done
