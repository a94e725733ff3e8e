"""The CLI refuses bad fault parameters before touching Ray, fails fast on a dead address, and
trusts only a private embedded-cluster address file."""

import os
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from islands.orchestrator import cli, job

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if a command gets as far as connecting to a cluster."""
    monkeypatch.setattr(cli, "_connect", lambda address: pytest.fail("connected to Ray"))


@pytest.mark.parametrize("argv,message", [
    (["chaos", "slowdown", "us-east:0", "--factor", "-3"], "--factor: must be > 1"),
    (["chaos", "slowdown", "us-east:0", "--factor", "1"], "--factor: must be > 1"),
    (["chaos", "slowdown", "us-east:0", "--duration", "0"], "--duration: must be > 0"),
    (["chaos", "hang", "us-east:0", "--duration", "-10"], "--duration: must be > 0"),
    (["chaos", "network", "us-east", "--duration", "0"], "--duration: must be > 0"),
    (["chaos", "network", "us-east", "--latency-ms", "-5"], "--latency-ms: must be >= 0"),
    (["chaos", "network", "us-east", "--bandwidth-gbps", "0"], "--bandwidth-gbps: must be > 0"),
    (["chaos", "network", "us-east", "--bandwidth-gbps", "-1"], "--bandwidth-gbps: must be > 0"),
    (["chaos", "partition", "us-east", "--duration", "-1"], "--duration: must be > 0"),
    (["chaos", "region-loss", "us-east", "--repair", "-2"], "--repair: must be >= 0"),
    (["chaos", "hang", "us-east:0", "--duration", "nan"], "--duration: must be a finite number"),
    (["chaos", "hang", "us-east:0", "--duration", "soon"], "'soon' is not a number"),
    (["run", "x.yaml", "--duration", "-1"], "--duration: must be > 0"),
    (["run", "x.yaml", "--resume", "--force"], "not allowed with argument"),
])
def test_bad_fault_parameters_exit_2_before_connecting(argv, message, capsys, no_ray):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["chaos", "slowdown", "us-east:0", "--factor", "1.5", "--duration", "0.5"],
    ["chaos", "network", "us-east", "--latency-ms", "0", "--bandwidth-gbps", "0.1"],
    ["chaos", "region-loss", "us-east", "--repair", "0"],
])
def test_good_fault_parameters_go_on_to_connect(argv, monkeypatch):
    class Connected(Exception):
        pass

    def connect(address):
        raise Connected

    monkeypatch.setattr(cli, "_connect", connect)
    with pytest.raises(Connected):
        cli.main(argv)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _islands(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "islands.orchestrator.cli", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


def test_status_at_a_dead_address_fails_in_seconds():
    address = f"127.0.0.1:{_closed_port()}"
    t0 = time.time()
    result = _islands("status", "--address", address, timeout=60)
    assert time.time() - t0 < 15
    assert result.returncode != 0
    assert address in result.stderr


def test_status_at_an_address_that_never_answers_gives_up_at_the_connect_timeout():
    """Something accepts TCP there but never speaks Ray: ray.init alone would wait for minutes."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    try:
        t0 = time.time()
        result = _islands("status", "--address", address,
                          env={"ISLANDS_CONNECT_TIMEOUT_S": "3"}, timeout=60)
        assert time.time() - t0 < 20
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()
    assert result.returncode != 0
    assert address in result.stderr


def test_probe_address():
    assert job.probe_address("auto") is None and job.probe_address("local") is None
    port = _closed_port()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        problem = job.probe_address(address, timeout_s=2)
        assert problem and address in problem


def test_cli_run_refuses_a_used_run_dir_before_ray(tmp_path, capsys):
    import ray

    config = tmp_path / "job.yaml"
    config.write_text("name: demo\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("{}")
    assert cli.main(["run", str(config), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert str(run_dir) in err and "--resume" in err and "--force" in err
    assert (run_dir / "summary.json").read_text() == "{}"
    assert not ray.is_initialized()


def test_cli_run_into_a_run_dir_that_cannot_be_written_is_one_line_rc_2(tmp_path, capsys):
    """Before, a run dir that could not be created ended in a traceback with rc 1."""
    import ray

    config = tmp_path / "job.yaml"
    config.write_text("name: demo\n")
    blocker = tmp_path / "a-file"       # (root writes anywhere: a file where a directory goes)
    blocker.write_text("mine")
    assert cli.main(["run", str(config), "--run-dir", str(blocker / "run")]) == 2
    err = capsys.readouterr().err
    assert "cannot be created or written" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and blocker.read_text() == "mine"
    assert not ray.is_initialized()


# -- the embedded cluster's address file ------------------------------------------------------

@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / "islands"


def test_address_file_is_private_and_read_back(runtime_dir):
    assert job.embedded_address_file() == str(runtime_dir / "embedded_cluster_address")
    job._write_embedded_address("127.0.0.1:6379")
    assert stat.S_IMODE(os.stat(runtime_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(job.embedded_address_file()).st_mode) == 0o600
    assert job.embedded_address() == "127.0.0.1:6379"
    job._write_embedded_address("127.0.0.1:6380")  # replaced, still private
    assert job.embedded_address() == "127.0.0.1:6380"
    assert stat.S_IMODE(os.stat(job.embedded_address_file()).st_mode) == 0o600
    job._forget_embedded_address()
    assert job.embedded_address() is None


def test_address_file_falls_back_to_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert job.embedded_address_file() == str(tmp_path / ".cache" / "islands"
                                              / "embedded_cluster_address")
    assert not job.embedded_address_file().startswith("/tmp/islands")


def test_an_address_file_others_may_write_is_ignored(runtime_dir, caplog):
    job._write_embedded_address("127.0.0.1:6379")
    os.chmod(job.embedded_address_file(), 0o666)
    with caplog.at_level("WARNING", logger="islands.job"):
        assert job.embedded_address() is None
    assert "mode 666" in caplog.text


def test_an_address_file_of_another_user_is_ignored(runtime_dir, monkeypatch, caplog):
    job._write_embedded_address("127.0.0.1:6379")
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    with caplog.at_level("WARNING", logger="islands.job"):
        assert job.embedded_address() is None
    assert "owned by uid" in caplog.text


def test_a_linked_address_file_is_ignored(runtime_dir, tmp_path, caplog):
    elsewhere = tmp_path / "planted"
    elsewhere.write_text("10.0.0.66:6379")
    os.chmod(elsewhere, 0o600)
    runtime_dir.mkdir(mode=0o700)
    os.symlink(elsewhere, job.embedded_address_file())
    with caplog.at_level("WARNING", logger="islands.job"):
        assert job.embedded_address() is None


def test_a_shared_temp_address_is_not_read(tmp_path, monkeypatch):
    """The old location, /tmp/islands/embedded_cluster_address, any user could plant."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "islands").mkdir()
    (tmp_path / "islands" / "embedded_cluster_address").write_text("10.0.0.66:6379")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "private"))
    (tmp_path / "private").mkdir()
    assert job.embedded_address() is None


# -- the metrics endpoint binds loopback unless told otherwise ----------------------------------

def test_metrics_host():
    from islands.orchestrator.config import parse

    assert job.metrics_host(parse({}), embedded=True) == "127.0.0.1"
    assert job.metrics_host(parse({}), embedded=False, node_ip="10.0.0.5") == "10.0.0.5"
    explicit = parse({"metrics": {"host": "0.0.0.0"}})
    assert job.metrics_host(explicit, embedded=True) == "0.0.0.0"


def test_metrics_serve_binds_loopback_by_default():
    import inspect

    from islands.orchestrator import metrics

    assert inspect.signature(metrics.serve).parameters["addr"].default == "127.0.0.1"
    server, port = metrics.serve(lambda: {}, port=0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()


def test_status_names_the_learner_a_prestarted_spare_is_for():
    table = {"learners": {}, "syncer": {"epoch": 0, "merges": 0},
             "spares": {"spare:a:0": {"region": "a", "state": "ready", "for": None},
                        "spare:a:1": {"region": "a", "state": "starting", "for": "a:2"}}}
    text = cli.format_status(table)
    assert "spare spare:a:0: region a  ready\n" in text + "\n"
    assert "spare spare:a:1: region a  starting  for a:2's restart" in text
