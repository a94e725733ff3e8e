"""What a region's hardware means for its learners: devices per learner, hosts per learner, and
what each learner asks Ray for (docs/accelerators.md).

Pure functions over plain values (no Ray, no JAX): ``config.py`` validates with them and
``runtime.py`` turns their answer into Ray options and a learner's environment.

TPU slices come from a small table of the TPU generations GKE and Cloud TPU offer. A multi-host
slice has 4 chips per host; v5e and v6e also come as single hosts of up to 8 chips (topologies
1x1, 2x2, 2x4). Hand-checked against Cloud TPU's machine types (ct4p-hightpu-4t,
ct5p-hightpu-4t, ct5lp-hightpu-{1,4,8}t, ct6e-standard-{1,4,8}t) and against Ray's own
``ray.util.tpu.get_chips_per_host`` in tests/unit/test_accelerators.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

ACCELERATORS = ("cpu", "gpu", "tpu")


@dataclass(frozen=True)
class TpuGeneration:
    """One TPU generation: its GKE node label, Ray's name for it, and its host shapes."""

    gke_accelerator: str          # cloud.google.com/gke-tpu-accelerator
    ray_version: str              # ray.util.tpu's accelerator_version
    dims: int                     # topology AxB (2) or AxBxC (3)
    chips_per_host: int           # hosts of a multi-host slice
    single_host_topologies: tuple  # topologies that are one host of all their chips


TPU_GENERATIONS = {
    "v4": TpuGeneration("tpu-v4-podslice", "v4", 3, 4, ("2x2x1",)),
    "v5e": TpuGeneration("tpu-v5-lite-podslice", "v5litepod", 2, 4, ("1x1", "2x2", "2x4")),
    "v5p": TpuGeneration("tpu-v5p-slice", "v5p", 3, 4, ("2x2x1",)),
    "v6e": TpuGeneration("tpu-v6e-slice", "v6e", 2, 4, ("1x1", "2x2", "2x4")),
}
TPU_TYPES = tuple(TPU_GENERATIONS)
# A process may hold this many chips of a host (libtpu; Ray refuses other TPU requests).
TPU_CHIPS_PER_PROCESS = (1, 2, 4, 8)
TOPOLOGY = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")


def topology_chips(topology: str) -> int:
    """Chips in a topology.

    >>> topology_chips("2x2x2"), topology_chips("4x4"), topology_chips("1x1")
    (8, 16, 1)
    """
    if not TOPOLOGY.match(topology):
        raise ValueError(f"topology {topology!r} must read AxB or AxBxC (e.g. 2x2x1)")
    chips = 1
    for side in topology.split("x"):
        chips *= int(side)
    return chips


def tpu_chips_per_host(tpu_type: str, topology: str) -> int:
    """Chips on each host of a slice: all of them for a single-host topology, else the
    generation's multi-host size.

    >>> tpu_chips_per_host("v6e", "2x4"), tpu_chips_per_host("v6e", "4x4")
    (8, 4)
    >>> tpu_chips_per_host("v5p", "2x2x1"), tpu_chips_per_host("v5p", "2x2x2")
    (4, 4)
    """
    generation = check_tpu_topology(tpu_type, topology)
    if topology in generation.single_host_topologies:
        return topology_chips(topology)
    return generation.chips_per_host


def tpu_hosts(tpu_type: str, topology: str) -> int:
    """Hosts of a slice: chips / chips per host.

    >>> tpu_hosts("v5p", "2x2x1"), tpu_hosts("v5p", "2x2x2"), tpu_hosts("v6e", "4x4")
    (1, 2, 4)
    """
    return topology_chips(topology) // tpu_chips_per_host(tpu_type, topology)


def check_tpu_topology(tpu_type: str, topology: str) -> TpuGeneration:
    """The generation of ``tpu_type`` once ``topology`` fits it; ValueError saying why not."""
    if tpu_type not in TPU_GENERATIONS:
        raise ValueError(f"tpu_type {tpu_type!r} is not one of {', '.join(TPU_TYPES)}")
    generation = TPU_GENERATIONS[tpu_type]
    chips = topology_chips(topology)
    if len(topology.split("x")) != generation.dims:
        shape = "AxB" if generation.dims == 2 else "AxBxC"
        raise ValueError(f"topology {topology!r}: {tpu_type} slices are {shape}")
    if topology not in generation.single_host_topologies and chips % generation.chips_per_host:
        raise ValueError(f"topology {topology!r} has {chips} chips, not a whole number of "
                         f"{tpu_type} hosts ({generation.chips_per_host} chips each)")
    return generation


@dataclass(frozen=True)
class LearnerDevices:
    """What one learner of a region runs on and asks Ray for."""

    accelerator: str = "cpu"        # cpu | gpu | tpu
    devices_per_host: float = 1     # GPUs (fractional below 1), TPU chips, or virtual CPU devices
    hosts: int = 1                  # hosts of one learner (only 1 runs today)
    tpu_type: Optional[str] = None
    topology: Optional[str] = None

    @property
    def jax_platform(self) -> Optional[str]:
        """The JAX platform a learner is pinned to: ``cpu`` for CPU learners (they asked Ray for
        no accelerator, and Ray does not hide a node's GPUs from them); None lets JAX pick the
        devices Ray assigned."""
        return "cpu" if self.accelerator == "cpu" else None

    @property
    def ray_resource(self) -> Optional[str]:
        """The Ray resource that counts this learner's devices (None for CPU learners)."""
        return {"gpu": "GPU", "tpu": "TPU"}.get(self.accelerator)


def learner_devices(accelerator: str = "cpu", devices_per_host: Optional[float] = None,
                    hosts_per_learner: Optional[int] = None, tpu_type: Optional[str] = None,
                    topology: Optional[str] = None) -> LearnerDevices:
    """A region's learner devices from its config, with the defaults filled in; ValueError
    starting with the key that is wrong.

    Defaults: one device, one host; a TPU learner holds every chip of one host and spans the
    topology's hosts.

    >>> learner_devices("gpu", 0.25)
    LearnerDevices(accelerator='gpu', devices_per_host=0.25, hosts=1, tpu_type=None, topology=None)
    >>> learner_devices("tpu", tpu_type="v6e", topology="4x4").hosts
    4
    """
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator: {accelerator!r} is not one of {', '.join(ACCELERATORS)}")
    if accelerator != "tpu":
        for key, value in (("tpu_type", tpu_type), ("topology", topology)):
            if value is not None:
                raise ValueError(f"{key}: only for accelerator: tpu (this region is "
                                 f"{accelerator})")
    if devices_per_host is not None and devices_per_host <= 0:
        raise ValueError(f"devices_per_host: must be > 0, got {devices_per_host:g}")
    if accelerator == "cpu":
        count = _whole("devices_per_host", 1 if devices_per_host is None else devices_per_host,
                       "a CPU learner's virtual devices")
        return LearnerDevices("cpu", count, hosts_per_learner or 1)
    if accelerator == "gpu":
        count = 1 if devices_per_host is None else devices_per_host
        if count > 1:   # Ray shares a GPU only below one; above, quantities are whole
            count = _whole("devices_per_host", count, "more than one GPU")
        return LearnerDevices("gpu", count, hosts_per_learner or 1)
    return _tpu_devices(devices_per_host, hosts_per_learner, tpu_type, topology)


def _tpu_devices(devices_per_host, hosts_per_learner, tpu_type, topology) -> LearnerDevices:
    for key, value in (("tpu_type", tpu_type), ("topology", topology)):
        if value is None:
            raise ValueError(f"{key}: required for accelerator: tpu (e.g. tpu_type: v5p, "
                             "topology: 2x2x1)")
    try:
        per_host = tpu_chips_per_host(tpu_type, topology)
    except ValueError as exc:
        key = "tpu_type" if tpu_type not in TPU_GENERATIONS else "topology"
        raise ValueError(f"{key}: {exc}") from None
    hosts = topology_chips(topology) // per_host
    if hosts_per_learner is not None and hosts_per_learner != hosts:
        raise ValueError(f"hosts_per_learner: {tpu_type} {topology} spans {hosts} host(s) "
                         f"({per_host} chips each), not {hosts_per_learner}; leave it out")
    chips = _whole("devices_per_host", per_host if devices_per_host is None else devices_per_host,
                   "TPU chips")
    if chips not in TPU_CHIPS_PER_PROCESS or chips > per_host or (hosts > 1 and chips != per_host):
        allowed = [c for c in TPU_CHIPS_PER_PROCESS if c <= per_host] if hosts == 1 else [per_host]
        raise ValueError(f"devices_per_host: {chips} chips per learner on {tpu_type} {topology} "
                         f"({per_host} chips per host); use one of {allowed}")
    return LearnerDevices("tpu", chips, hosts, tpu_type, topology)


def _whole(key: str, value: float, what: str) -> int:
    if value != int(value):
        raise ValueError(f"{key}: {what} must be a whole number, got {value:g}")
    return int(value)


def unit_problem(devices: LearnerDevices, sharding: str, spares: int) -> Optional[str]:
    """Why a region's multi-host units cannot run as configured, or None. A unit's hosts replay
    its leader's steps on replicated parameters (learners/gang.py): FSDP across hosts and warm
    spares of a whole gang are not built yet."""
    if devices.hosts == 1:
        return None
    what = (f"tpu {devices.tpu_type} {devices.topology} spans {devices.hosts} hosts"
            if devices.accelerator == "tpu" else f"{devices.hosts} hosts per learner")
    if sharding != "replicated":
        return (f"learner.sharding: {sharding!r} with {what}: a multi-host unit keeps its "
                "parameters replicated (FSDP across hosts is not supported yet); use "
                "sharding: replicated or one host per learner")
    if spares:
        return (f"health.spares: {spares} spare(s) for a region whose units span several "
                f"hosts ({what}): warm spares of multi-host units are not supported yet")
    return None


def unit_bundle(region: str, devices: LearnerDevices, cpus: float) -> dict:
    """One host's bundle of a unit's placement group: the learner's CPU share, one unit of
    ``region:<region>`` and the host's devices.

    >>> unit_bundle("eu", learner_devices("gpu", 2, 2), 0.25)
    {'CPU': 0.25, 'region:eu': 1, 'GPU': 2}
    """
    bundle = {"CPU": cpus, f"region:{region}": 1}
    if devices.ray_resource is not None:
        bundle[devices.ray_resource] = devices.devices_per_host
    return bundle


def gang_strategy(devices: LearnerDevices, region_nodes: int) -> str:
    """How a unit's bundles are placed: one host each on distinct nodes where the region has
    enough nodes (always for a TPU slice: its hosts are separate VMs), else packed onto as few
    as possible (a laptop or one big machine standing in for several hosts).

    >>> gang_strategy(learner_devices("cpu", 1, 2), 1), gang_strategy(learner_devices("cpu", 1, 2), 3)
    ('PACK', 'STRICT_SPREAD')
    """
    if devices.accelerator == "tpu" or region_nodes >= devices.hosts:
        return "STRICT_SPREAD"
    return "PACK"


def tpu_slice_request(devices: LearnerDevices, region: str, cpus: float, name: str) -> dict:
    """The keyword arguments of ``ray.util.tpu.slice_placement_group`` that reserve one multi-host
    TPU unit: the slice's topology and generation, one bundle per host with all its chips, the
    learner's CPU share and the region's marker, detached (the unit outlives a controller
    restart) and named so a restarted controller can release it.

    >>> tpu_slice_request(learner_devices("tpu", tpu_type="v5p", topology="2x2x2"), "eu", 0.25,
    ...                   "islands-unit:eu:0:0")["resources_per_bundle"]
    {'CPU': 0.25, 'region:eu': 1, 'TPU': 4}
    """
    if devices.accelerator != "tpu":
        raise ValueError(f"a {devices.accelerator} learner reserves no TPU slice")
    return {"topology": devices.topology,
            "accelerator_version": TPU_GENERATIONS[devices.tpu_type].ray_version,
            "resources_per_bundle": unit_bundle(region, devices, cpus),
            "strategy": "STRICT_SPREAD", "name": name, "lifetime": "detached"}


def ray_request(devices: LearnerDevices) -> dict:
    """The device part of a learner's Ray options: ``num_gpus``, or the ``TPU`` resource, so Ray
    reserves the devices and sets the learner's visible devices (CUDA_VISIBLE_DEVICES,
    TPU_VISIBLE_CHIPS). A CPU learner asks for none.

    >>> ray_request(learner_devices("gpu", 0.5)), ray_request(learner_devices("cpu", 4))
    ({'num_gpus': 0.5}, {})
    >>> ray_request(learner_devices("tpu", tpu_type="v5p", topology="2x2x1"))
    {'resources': {'TPU': 4}}
    """
    if devices.accelerator == "gpu":
        return {"num_gpus": devices.devices_per_host}
    if devices.accelerator == "tpu":
        return {"resources": {"TPU": devices.devices_per_host}}
    return {}


def xla_device_flags(devices: LearnerDevices) -> str:
    """XLA flags for a learner's devices: N virtual CPU devices for a CPU learner of N > 1 (a
    multi-device learner testable on one machine); nothing otherwise.

    >>> xla_device_flags(learner_devices("cpu", 4))
    '--xla_force_host_platform_device_count=4'
    >>> xla_device_flags(learner_devices("cpu")), xla_device_flags(learner_devices("gpu", 2))
    ('', '')
    """
    if devices.accelerator == "cpu" and devices.devices_per_host > 1:
        return f"--xla_force_host_platform_device_count={int(devices.devices_per_host)}"
    return ""


def region_shortage(region: str, learners: int, devices: LearnerDevices,
                    nodes: list) -> Optional[str]:
    """Why the alive nodes that carry ``region:<region>`` cannot hold the region's learners'
    devices, or None. ``nodes``: ``ray.nodes()`` entries (``Alive``, ``Resources``).

    A learner's devices must be on one node, so a node holds floor(its devices / devices per
    learner) learners; the message gives the totals and, when they would suffice, the packing.
    """
    resource = devices.ray_resource
    if resource is None or learners == 0:
        return None
    marker = f"region:{region}"
    have = [float(n.get("Resources", {}).get(resource, 0.0)) for n in nodes
            if n.get("Alive") and n.get("Resources", {}).get(marker, 0.0) > 0]
    per_host = devices.devices_per_host
    hosts = learners * devices.hosts   # each host of a unit holds its devices on one node
    fits = sum(int(h / per_host + 1e-9) for h in have)
    if fits >= hosts:
        return None
    need = hosts * per_host
    of = f"{learners} learners" + (f" × {devices.hosts} hosts" if devices.hosts > 1 else "")
    line = (f"region {region}: {of} × {per_host:g} {resource} need "
            f"{need:g} {resource} on nodes with {marker}, the cluster has {sum(have):g}")
    if sum(have) + 1e-9 >= need:
        room = f"{fits} learners" if devices.hosts == 1 else f"{fits} hosts"
        line += (f" (spread over {len(have)} nodes, room for {room}: a learner's "
                 "devices must be on one node)")
    return line


def tpu_slice_bundles(devices: LearnerDevices, region: str) -> list:
    """The placement-group bundles of one TPU learner unit: one bundle per host of the slice,
    each with that host's chips, a CPU and the region's marker, as ``ray.util.tpu``'s
    ``SlicePlacementGroup`` would reserve them (its label selector adds the slice name, known
    only once a slice's head is reserved on a live cluster).

    >>> tpu_slice_bundles(learner_devices("tpu", tpu_type="v6e", topology="2x4"), "eu")
    [{'CPU': 1, 'TPU': 8, 'region:eu': 1}]
    """
    if devices.accelerator != "tpu":
        raise ValueError(f"a {devices.accelerator} learner reserves no TPU slice")
    per_host = tpu_chips_per_host(devices.tpu_type, devices.topology)
    return [{"CPU": 1, "TPU": per_host, f"region:{region}": 1} for _ in range(devices.hosts)]
