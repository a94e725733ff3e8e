"""A learner proves its devices (learners/devices.py): the pure check, and the real path in a
fresh process whose environment asks for a GPU this machine lacks."""

import os
import subprocess
import sys

import pytest

from islands.learners.devices import (BACKEND_MARK, MISMATCH_MARK, BackendUnavailable,
                                      DeviceMismatch, DeviceReport, DeviceRequest, check_devices,
                                      device_fault, device_problem, is_device_mismatch,
                                      mismatch_node)
from islands.orchestrator import accelerators as acc
from islands.orchestrator.runtime import Role, process_env, ray_env_vars

H200 = DeviceReport("gpu", "gpu", "NVIDIA H200", 1)
CPU = DeviceReport("cpu", "cpu", "cpu", 1)


def test_matching_devices_pass():
    assert device_problem(DeviceRequest("g", "gpu", 0.25, "num_gpus=0.25"), H200) is None
    assert device_problem(DeviceRequest("g", "gpu", 2, "num_gpus=2"),
                          DeviceReport("gpu", "gpu", "NVIDIA H200", 2)) is None
    assert device_problem(DeviceRequest("c", "cpu", 4), DeviceReport("cpu", "cpu", "cpu", 4)) is None
    assert device_problem(DeviceRequest("t", "tpu", 4, "TPU=4"),
                          DeviceReport("tpu", "tpu", "TPU v5p", 4)) is None


def test_a_gpu_learner_on_the_cpu_is_refused_naming_the_inherited_platform():
    """The H200 run: the learner inherited JAX_PLATFORMS=cpu and trained on the CPU."""
    line = device_problem(DeviceRequest("gpu-a", "gpu", 0.2, "num_gpus=0.2"), CPU,
                          env={"JAX_PLATFORMS": "cpu"}, has_plugin=True)
    assert line == (
        "device check failed: region gpu-a asked Ray for num_gpus=0.2 and needs 1 gpu device(s) "
        "(a 0.2 share); JAX gave it 1 cpu device(s) (cpu), backend cpu; likely cause: "
        "JAX_PLATFORMS=cpu reached the learner (set on the node, or inherited from the process "
        "that created it)")
    assert "\n" not in line and is_device_mismatch(line)


@pytest.mark.parametrize("env,has_plugin,cause", [
    ({"JAX_PLATFORMS": "cuda"}, False, "a CPU-only jaxlib"),
    ({"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": ""}, True, "CUDA_VISIBLE_DEVICES is empty"),
    ({"JAX_PLATFORMS": "cuda"}, True, "held by another process"),
])
def test_the_likely_cause_of_a_gpu_backend_that_did_not_come_up(env, has_plugin, cause):
    report = DeviceReport(None, error="Unable to initialize backend 'cuda': no CUDA devices")
    line = device_problem(DeviceRequest("g", "gpu", 1, "num_gpus=1"), report, env, has_plugin,
                          has_device=True)
    assert line.startswith(MISMATCH_MARK) and cause in line
    assert "no backend (Unable to initialize backend 'cuda'" in line


def test_a_wrong_device_count_and_a_cpu_learner_on_a_gpu_are_refused():
    two = DeviceReport("gpu", "gpu", "NVIDIA H100", 2)
    line = device_problem(DeviceRequest("g", "gpu", 1, "num_gpus=1"), two,
                          {"JAX_PLATFORMS": "cuda"}, True)
    assert "needs 1 gpu device(s)" in line and "JAX gave it 2 gpu device(s)" in line
    assert "visible-devices variable" in line
    line = device_problem(DeviceRequest("c", "cpu", 1), H200, {"JAX_PLATFORMS": "cuda"}, True)
    assert "JAX_PLATFORMS=cuda reached the learner" in line


def test_check_devices_in_this_process_passes_on_the_cpu_and_raises_when_asked_for_a_gpu():
    report = check_devices(DeviceRequest("c", "cpu", len(__import__("jax").local_devices())))
    assert report.backend == "cpu" and report.count >= 1 and report.error is None
    with pytest.raises(DeviceMismatch, match="region g asked Ray for num_gpus=1"):
        check_devices(DeviceRequest("g", "gpu", 1, "num_gpus=1"))
    assert check_devices(None).backend == "cpu"   # a spec built by hand is not checked


def test_a_gpu_learners_environment_never_falls_back_to_the_cpu():
    """The real path, in a fresh process: the GPU learner's own environment (over an inherited
    JAX_PLATFORMS=cpu) makes JAX try CUDA, and on this CPU-only machine the check refuses it."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           **ray_env_vars(process_env(Role.LEARNER, acc.learner_devices("gpu", 0.5)))}
    code = ("from islands.learners.devices import *\n"
            "try:\n    check_devices(DeviceRequest('g', 'gpu', 0.5, 'num_gpus=0.5'))\n"
            "except DeviceMismatch as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("device check failed: region g asked Ray for num_gpus=0.5"), out
    assert "JAX gave it no backend (JAX_PLATFORMS=cuda did not start" in line
    assert "likely cause: a CPU-only jaxlib" in line


DOWN = DeviceReport(None, error="Unable to initialize backend 'cuda': CUDA_ERROR_OUT_OF_MEMORY")
GPU = DeviceRequest("g", "gpu", 1, "num_gpus=1")


@pytest.mark.parametrize("request_, report, env, has_plugin, fault", [
    # Deterministic: the same start on the same node fails the same way.
    (GPU, CPU, {"JAX_PLATFORMS": "cuda"}, True, "config"),            # a wrong backend came up
    (GPU, DeviceReport("gpu", "gpu", "H100", 2), {"JAX_PLATFORMS": "cuda"}, True, "config"),
    (GPU, DOWN, {"JAX_PLATFORMS": "cpu"}, True, "config"),            # JAX_PLATFORMS excludes it
    (GPU, DOWN, {"JAX_PLATFORMS": "cuda"}, False, "config"),          # no plugin
    (GPU, DOWN, {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": ""}, True, "config"),
    # May pass: the plugin is there, the platform asked for, the backend did not come up.
    (GPU, DOWN, {"JAX_PLATFORMS": "cuda"}, True, "backend"),
    (GPU, DOWN, {}, True, "backend"),
    (GPU, H200, {"JAX_PLATFORMS": "cuda"}, True, None),
])
def test_a_deterministic_mismatch_is_config_and_a_backend_that_did_not_start_is_not(
        request_, report, env, has_plugin, fault):
    # On a node with its GPU's device files (the backend's failure may pass) ...
    assert device_fault(request_, report, env, has_plugin, has_device=True) == fault
    # ... and on one without: no CUDA backend can ever start there.
    assert device_fault(request_, report, env, has_plugin, has_device=False) == (
        "config" if fault == "backend" else fault)


def test_a_gpu_node_without_device_files_is_named_as_such():
    line = device_problem(GPU, DOWN, {"JAX_PLATFORMS": "cuda"}, True, has_device=False)
    assert "likely cause: no NVIDIA device on this node" in line


def test_a_backend_that_did_not_start_raises_its_own_line_naming_the_node():
    """The real path in a fresh process: JAX asked for CUDA on this CPU-only machine, with a
    plugin said to be there (as where a GPU is held by another process): not a configuration
    failure (no MISMATCH_MARK), so the fleet restarts it as a crash."""
    env = {**os.environ, **ray_env_vars(process_env(Role.LEARNER, acc.learner_devices("gpu", 1)))}
    code = ("from islands.learners.devices import *\n"
            "try:\n    check_devices(DeviceRequest('g', 'gpu', 1, 'num_gpus=1'), 'ab12',"
            " has_plugin=True, has_device=True)\n"
            "except BackendUnavailable as exc:\n    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith(f"BackendUnavailable {BACKEND_MARK}: region g asked Ray"), out
    assert "JAX gave it no backend (JAX_PLATFORMS=cuda did not start" in line
    assert "held by another process" in line and line.endswith("(node ab12)")
    assert not is_device_mismatch(line) and mismatch_node(line) == "ab12"
    assert issubclass(BackendUnavailable, RuntimeError)


def test_a_mismatch_names_its_node():
    with pytest.raises(DeviceMismatch) as info:
        check_devices(GPU, node_id="n7")
    assert mismatch_node(str(info.value)) == "n7" and is_device_mismatch(str(info.value))
    assert mismatch_node(MISMATCH_MARK + ": region g ...") is None


def test_the_cli_driver_never_opens_an_accelerator(tmp_path):
    """``islands …`` is a driver: whatever the shell exported, it runs JAX on the CPU and
    preallocates nothing (on the H200 the driver took 75 % of the card before any learner)."""
    env = {**os.environ, "JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
           "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.75"}
    code = ("import contextlib, io, os\n"
            "from islands.orchestrator.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['config', 'check', 'deploy/examples/local.yaml']) == 0\n"
            "import jax\n"
            "print(jax.default_backend(), os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'],\n"
            "      os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    assert out.stdout.split() == ["cpu", "false", "None"], out


def test_an_embedded_dashboard_without_its_packages_is_refused_naming_the_key(monkeypatch):
    """A GPU machine with a stripped Ray (no dashboard packages): the line names run.dashboard
    instead of Ray's own exception, before any cluster starts."""
    pytest.importorskip("ray")
    from islands.orchestrator import job
    from islands.orchestrator.config import ConfigError, parse

    monkeypatch.setattr(job, "dashboard_dependency_error", lambda: "No module named 'aiohttp'")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = parse({"regions": {"a": {"learners": 1}}, "run": {"dashboard": True}})
    with pytest.raises(ConfigError, match=r"run.dashboard: true starts Ray's dashboard, whose "
                                          r"packages are not installed here \(No module named "
                                          r"'aiohttp'\); set run.dashboard: false"):
        job.start_ray(config, None)
    import ray

    assert not ray.is_initialized()
