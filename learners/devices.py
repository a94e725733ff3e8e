"""A learner proves its devices: at start it reads the backend and local devices JAX gave it and
refuses to train on anything else than what its region asked Ray for (docs/accelerators.md).

A learner that silently trained on the CPU while its GPU sat idle is the failure this guards
against: the environment decides the platform (``orchestrator/runtime.py:process_env``), and an
inherited ``JAX_PLATFORMS``, a CPU-only jaxlib or a device held by another process would all
otherwise go unnoticed. ``device_problem`` is pure (tested without JAX devices);
``check_devices`` is what a learner, a spare and each host of a unit call before training.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from dataclasses import asdict, dataclass
from typing import Mapping, Optional

# JAX's name for each accelerator's backend (``jax.default_backend()``).
BACKEND = {"cpu": "cpu", "gpu": "gpu", "tpu": "tpu"}
# What installs each accelerator's jaxlib plugin.
PLUGINS = {"gpu": ("jax_cuda13_plugin", "jax_cuda12_plugin"), "tpu": ("libtpu",)}
INSTALL = {"gpu": "pip install 'islands[cuda]'", "tpu": "pip install 'islands[tpu]'"}
# Starts every device-check error: the controller retires such a learner instead of
# restarting it (a configuration failure comes back on every restart).
MISMATCH_MARK = "device check failed"
# Starts the error of a backend that did not start for a reason that may pass (a device held
# for a moment by a dying predecessor or another tenant, a driver hiccup): a crash, restarted
# under the crash budget with its backoff.
BACKEND_MARK = "device backend did not start"
# What ``device_fault`` says.
FAULT_CONFIG, FAULT_BACKEND = "config", "backend"
NODE = re.compile(r"\(node ([0-9A-Za-z]+)\)")
# The variables that decide a learner's devices (``LearnerUnit.environment`` shows them).
ENVIRONMENT_SHOWN = ("JAX_PLATFORMS", "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE",
                     "XLA_PYTHON_CLIENT_MEM_FRACTION", "CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS")


@dataclass(frozen=True)
class DeviceRequest:
    """What a learner of a region must find at start."""

    region: str = ""
    accelerator: str = "cpu"           # cpu | gpu | tpu
    devices_per_host: float = 1        # GPUs (fractional below 1), TPU chips or virtual CPUs
    ray_request: str = "no accelerator"   # what it asked Ray for, as the message says it

    @property
    def backend(self) -> str:
        return BACKEND[self.accelerator]

    @property
    def local_devices(self) -> int:
        """Devices JAX must show this host: a fractional GPU is still one whole device."""
        return max(1, int(self.devices_per_host))


@dataclass(frozen=True)
class DeviceReport:
    """What JAX gave this process: ``jax.default_backend()``, the platform and kind of its first
    local device, and how many local devices it sees; ``error`` when no backend came up."""

    backend: Optional[str]
    platform: Optional[str] = None
    kind: Optional[str] = None
    count: int = 0
    error: Optional[str] = None

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.error is not None:
            return f"no backend ({self.error})"
        return f"{self.count} {self.platform} device(s) ({self.kind}), backend {self.backend}"


class DeviceFault(RuntimeError):
    """A learner's device check failed (one line): it must not train on what it found."""


class DeviceMismatch(DeviceFault):
    """A learner's devices are not what its region asked for, and would not be on a restart
    on the same node: a configuration failure."""


class BackendUnavailable(DeviceFault):
    """The backend its region asked for is there but did not start: a crash (it may pass)."""


def apply_env(env: Mapping[str, Optional[str]]) -> None:
    """Makes this process's environment ``env`` (None: removed), before JAX initialises here.

    An inherited value is replaced, never merged. JAX reads its flags from the environment when
    it is imported, so if it already is, the platform is set through its config too; a backend
    that is already up cannot change, and ``check_devices`` then says so."""
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    jax = sys.modules.get("jax")
    if jax is not None and env.get("JAX_PLATFORMS") is not None:
        try:
            jax.config.update("jax_platforms", env["JAX_PLATFORMS"])
        except Exception:   # a backend already up: the device check names it
            pass


def observe_devices() -> DeviceReport:
    """Starts JAX's backend here (if not yet) and reports what it gave this process."""
    import jax

    try:
        backend = jax.default_backend()
        devices = jax.local_devices()
    except Exception as exc:   # "Unable to initialize backend 'cuda': ...", or a bare assert
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        platforms = os.environ.get("JAX_PLATFORMS") or "default"
        return DeviceReport(None, error=f"JAX_PLATFORMS={platforms} did not start: {text}")
    first = devices[0]
    return DeviceReport(backend, first.platform, first.device_kind, len(devices))


def plugin_installed(accelerator: str) -> bool:
    """Whether a jaxlib plugin for ``accelerator`` is importable here (CPU needs none)."""
    return accelerator == "cpu" or any(importlib.util.find_spec(name) is not None
                                       for name in PLUGINS.get(accelerator, ()))


# A node with an NVIDIA GPU and its driver loaded has these device files; without them no CUDA
# backend can ever start there (a deterministic mismatch, not a passing fault).
NVIDIA_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0")


def device_files_present(accelerator: str) -> bool:
    """Whether this node has the device files ``accelerator`` needs (checked for GPUs only: a
    TPU VM's runtime decides that itself)."""
    return accelerator != "gpu" or any(os.path.exists(p) for p in NVIDIA_DEVICE_FILES)


def likely_cause(request: DeviceRequest, report: DeviceReport, env: Mapping[str, str],
                 has_plugin: bool, has_device: Optional[bool] = None) -> str:
    """The most likely reason JAX gave ``report`` instead of ``request``, in words.

    >>> likely_cause(DeviceRequest("g", "gpu"), DeviceReport("cpu", "cpu", "cpu", 1),
    ...              {"JAX_PLATFORMS": "cpu"}, True)
    'JAX_PLATFORMS=cpu reached the learner (set on the node, or inherited from the process that created it)'
    """
    platforms = env.get("JAX_PLATFORMS", "")
    wanted = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}[request.accelerator]
    if platforms and wanted not in platforms.split(","):
        return (f"JAX_PLATFORMS={platforms} reached the learner (set on the node, or inherited "
                "from the process that created it)")
    if request.accelerator != "cpu" and not has_plugin:
        return (f"a CPU-only jaxlib: no {request.accelerator.upper()} plugin is installed where "
                f"the learner runs ({INSTALL[request.accelerator]})")
    if request.accelerator == "gpu" and env.get("CUDA_VISIBLE_DEVICES", None) == "":
        return "CUDA_VISIBLE_DEVICES is empty in the learner (set on the node?)"
    has_device = device_files_present(request.accelerator) if has_device is None else has_device
    if report.error is not None and not has_device:
        return ("no NVIDIA device on this node (no /dev/nvidiactl): its GPU resource is declared "
                "but no GPU or driver is there")
    if report.error is not None or report.backend != request.backend:
        return ("the device is held by another process or its driver is not loaded "
                "(nvidia-smi / the TPU runtime logs on that node)")
    return ("Ray assigned a different number of devices than the region asks for, or a "
            "visible-devices variable (CUDA_VISIBLE_DEVICES, TPU_VISIBLE_CHIPS, XLA_FLAGS) "
            "was set on the node")


def device_problem(request: DeviceRequest, report: DeviceReport,
                   env: Optional[Mapping[str, str]] = None,
                   has_plugin: Optional[bool] = None,
                   has_device: Optional[bool] = None) -> Optional[str]:
    """One line saying why a learner must not train on ``report``, or None when it matches the
    request (backend and local device count; a CPU learner of N virtual devices sees N).

    >>> device_problem(DeviceRequest("a", "gpu", 0.25, "num_gpus=0.25"),
    ...                DeviceReport("gpu", "gpu", "NVIDIA H200", 1)) is None
    True
    """
    if report.error is None and report.backend == request.backend \
            and report.count == request.local_devices:
        return None
    env = dict(os.environ) if env is None else env
    has_plugin = plugin_installed(request.accelerator) if has_plugin is None else has_plugin
    wanted = (f"{request.local_devices} {request.accelerator} device(s)"
              + (f" (a {request.devices_per_host:g} share)" if request.devices_per_host < 1 else ""))
    return (f"{MISMATCH_MARK}: region {request.region} asked Ray for {request.ray_request} and "
            f"needs {wanted}; JAX gave it {report.describe()}; likely cause: "
            f"{likely_cause(request, report, env, has_plugin, has_device)}")


def device_fault(request: DeviceRequest, report: DeviceReport,
                 env: Optional[Mapping[str, str]] = None,
                 has_plugin: Optional[bool] = None,
                 has_device: Optional[bool] = None) -> Optional[str]:
    """None when ``report`` matches ``request``; ``FAULT_CONFIG`` when the mismatch is deterministic
    (it would come back on every start on this node): a backend that came up wrong (another
    backend, another device count), ``JAX_PLATFORMS`` excluding the platform, no plugin, an
    empty ``CUDA_VISIBLE_DEVICES``, a GPU node without NVIDIA device files; when the backend asked for failed to start with
    none of those to explain it (a device held for a moment, a driver hiccup): ``FAULT_BACKEND``.

    >>> gpu = DeviceRequest("g", "gpu", 1, "num_gpus=1")
    >>> down = DeviceReport(None, error="Unable to initialize backend 'cuda'")
    >>> device_fault(gpu, down, {"JAX_PLATFORMS": "cuda"}, True, has_device=True)
    'backend'
    >>> device_fault(gpu, down, {"JAX_PLATFORMS": "cuda"}, True, has_device=False)
    'config'
    >>> device_fault(gpu, down, {"JAX_PLATFORMS": "cuda"}, False), device_fault(gpu, down, {"JAX_PLATFORMS": "cpu"}, True)
    ('config', 'config')
    >>> device_fault(gpu, DeviceReport("gpu", "gpu", "H100", 2), {}, True)
    'config'
    """
    if report.error is None and report.backend == request.backend \
            and report.count == request.local_devices:
        return None
    if report.error is None:
        return FAULT_CONFIG
    env = dict(os.environ) if env is None else env
    has_plugin = plugin_installed(request.accelerator) if has_plugin is None else has_plugin
    platforms = env.get("JAX_PLATFORMS", "")
    wanted = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}[request.accelerator]
    if platforms and wanted not in platforms.split(","):
        return FAULT_CONFIG
    if request.accelerator != "cpu" and not has_plugin:
        return FAULT_CONFIG
    if request.accelerator == "gpu" and env.get("CUDA_VISIBLE_DEVICES", None) == "":
        return FAULT_CONFIG
    if not (device_files_present(request.accelerator) if has_device is None else has_device):
        return FAULT_CONFIG
    return FAULT_BACKEND


def check_devices(request: Optional[DeviceRequest], node_id: Optional[str] = None,
                  env: Optional[Mapping[str, str]] = None,
                  has_plugin: Optional[bool] = None,
                  has_device: Optional[bool] = None) -> DeviceReport:
    """What JAX gave this process; raises ``DeviceMismatch`` (one line) when it is not what
    ``request`` asks for, ``BackendUnavailable`` when its backend failed to start for a reason
    that may pass (``device_fault``). ``node_id`` (default: this process's Ray node, when Ray
    is up) ends the line as ``(node <id>)``: the mark is that node's. No request (a spec built
    by hand): nothing is checked."""
    report = observe_devices()
    if request is None:
        return report
    fault = device_fault(request, report, env, has_plugin, has_device)
    if fault is None:
        return report
    line = device_problem(request, report, env, has_plugin, has_device)
    node_id = node_id or _this_node()
    if node_id:
        line += f" (node {node_id})"
    if fault == FAULT_BACKEND:
        raise BackendUnavailable(BACKEND_MARK + line[len(MISMATCH_MARK):])
    raise DeviceMismatch(line)


def _this_node() -> Optional[str]:
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:   # no node to name: the fleet then marks the region's unknown node
        pass
    return None


def mismatch_node(error: Optional[str]) -> Optional[str]:
    """The node a device-check line names (``(node <id>)``), or None.

    >>> mismatch_node("device check failed: region a ...; likely cause: x (node 4f2a)")
    '4f2a'
    """
    found = NODE.findall(error or "")
    return found[-1] if found else None


def is_backend_unavailable(error: Optional[str]) -> bool:
    """Whether an error text is a backend that did not start at the device check (a crash:
    ``BackendUnavailable``). A spare has no budget: the fleet backs its region's spares off on
    such failures and marks a node that keeps failing them (docs/accelerators.md).

    >>> is_backend_unavailable("RayTaskError: device backend did not start: region g ... (node 4f)")
    True
    """
    return bool(error) and BACKEND_MARK in error


def is_device_mismatch(error: Optional[str]) -> bool:
    """Whether a learner's error text is a failed device check (a configuration failure)."""
    return bool(error) and MISMATCH_MARK in error
