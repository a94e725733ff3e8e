"""A region's hardware: the TPU topology table, the config's refusals, what a learner asks Ray for
and its environment, and (on a local Ray cluster with fake GPUs and TPU chips) that Ray assigns
the devices and that a region short of them is named."""

import os
import re

import pytest

from islands.orchestrator import accelerators as acc
from islands.orchestrator import build
from islands.orchestrator.config import ConfigError, parse
from islands.learners.devices import DeviceRequest
from islands.orchestrator.runtime import (MANAGED_ENV, Role, learner_options, process_env,
                                          ray_env_vars)


# -- the TPU table, hand-checked against Cloud TPU's machine types ---------------------------------
@pytest.mark.parametrize("tpu_type, topology, chips, per_host, hosts", [
    ("v4", "2x2x1", 4, 4, 1),      # ct4p-hightpu-4t, one host
    ("v4", "2x2x2", 8, 4, 2),
    ("v4", "2x4x4", 32, 4, 8),
    ("v5p", "2x2x1", 4, 4, 1),     # ct5p-hightpu-4t
    ("v5p", "2x2x2", 8, 4, 2),
    ("v5p", "4x4x4", 64, 4, 16),
    ("v5e", "1x1", 1, 1, 1),       # ct5lp-hightpu-1t
    ("v5e", "2x2", 4, 4, 1),       # ct5lp-hightpu-4t
    ("v5e", "2x4", 8, 8, 1),       # ct5lp-hightpu-8t
    ("v5e", "4x4", 16, 4, 4),      # multi-host: 4-chip hosts
    ("v6e", "2x4", 8, 8, 1),       # ct6e-standard-8t
    ("v6e", "4x4", 16, 4, 4),
    ("v6e", "16x16", 256, 4, 64),
])
def test_tpu_topology_table(tpu_type, topology, chips, per_host, hosts):
    assert acc.topology_chips(topology) == chips
    assert acc.tpu_chips_per_host(tpu_type, topology) == per_host
    assert acc.tpu_hosts(tpu_type, topology) == hosts


@pytest.mark.parametrize("tpu_type, topology", [
    ("v4", "2x2x1"), ("v4", "2x2x2"), ("v5p", "2x2x1"), ("v5p", "4x4x4"), ("v5e", "1x1"),
    ("v5e", "2x4"), ("v5e", "8x8"), ("v6e", "2x2"), ("v6e", "2x4"), ("v6e", "4x4"),
    ("v6e", "16x16")])
def test_the_table_agrees_with_rays_slice_placement(tpu_type, topology):
    """``ray.util.tpu`` reserves a slice as one bundle per host of the host's chips; our bundles
    are the same (plus the region's marker)."""
    from ray.util.tpu import get_tpu_worker_resources

    version = acc.TPU_GENERATIONS[tpu_type].ray_version
    workers, bundle = get_tpu_worker_resources(topology, version)
    devices = acc.LearnerDevices("tpu", acc.tpu_chips_per_host(tpu_type, topology),
                                 acc.tpu_hosts(tpu_type, topology), tpu_type, topology)
    ours = acc.tpu_slice_bundles(devices, "r")
    assert len(ours) == workers
    assert all(b == {**bundle, "region:r": 1} for b in ours)


@pytest.mark.parametrize("tpu_type, topology, message", [
    ("v5p", "2x4", "topology '2x4': v5p slices are AxBxC"),
    ("v6e", "2x2x1", "topology '2x2x1': v6e slices are AxB"),
    ("v5p", "1x1x3", "topology '1x1x3' has 3 chips, not a whole number of v5p hosts (4 chips each)"),
    ("v7", "2x2", "tpu_type 'v7' is not one of v4, v5e, v5p, v6e"),
    ("v4", "2by2", "must read AxB or AxBxC"),
])
def test_bad_topologies_say_why(tpu_type, topology, message):
    with pytest.raises(ValueError) as info:
        acc.tpu_hosts(tpu_type, topology)
    assert message in str(info.value)


# -- the JobConfig ---------------------------------------------------------------------------------
def region(**fields):
    return parse({"regions": {"us-east": {"learners": 2, **fields}}}).regions["us-east"]


def refusal(**fields) -> str:
    with pytest.raises(ConfigError) as info:
        region(**fields)
    text = str(info.value)
    assert "\n" not in text, text   # one line
    return text


def test_defaults_are_one_cpu_device_on_one_host():
    assert region().devices() == acc.LearnerDevices("cpu", 1, 1)
    assert region(accelerator="gpu").devices() == acc.LearnerDevices("gpu", 1, 1)
    assert region(accelerator="gpu", devices_per_host=0.25).devices().devices_per_host == 0.25
    assert region(accelerator="cpu", devices_per_host=4).devices().devices_per_host == 4
    tpu = region(accelerator="tpu", tpu_type="v6e", topology="2x4").devices()
    assert (tpu.devices_per_host, tpu.hosts) == (8, 1)   # every chip of the host
    assert region(accelerator="tpu", tpu_type="v6e", topology="2x4",
                  devices_per_host=4).devices().devices_per_host == 4   # two learners per host


@pytest.mark.parametrize("fields, message", [
    ({"accelerator": "gpu", "devices_per_host": 1.5},
     "regions.us-east.devices_per_host: more than one GPU must be a whole number, got 1.5"),
    ({"devices_per_host": 2.5},
     "regions.us-east.devices_per_host: a CPU learner's virtual devices must be a whole number"),
    ({"devices_per_host": 0}, "regions.us-east.devices_per_host"),
    ({"accelerator": "tpu", "topology": "2x2"}, "regions.us-east.tpu_type: required for "
                                                "accelerator: tpu"),
    ({"accelerator": "tpu", "tpu_type": "v5p"}, "regions.us-east.topology: required"),
    ({"accelerator": "tpu", "tpu_type": "v5p", "topology": "2x4"},
     "regions.us-east.topology: topology '2x4': v5p slices are AxBxC"),
    ({"accelerator": "tpu", "tpu_type": "v9", "topology": "2x2"}, "regions.us-east.tpu_type"),
    ({"accelerator": "tpu", "tpu_type": "v6e", "topology": "2x4", "devices_per_host": 3},
     "regions.us-east.devices_per_host: 3 chips per learner on v6e 2x4 (8 chips per host); use "
     "one of [1, 2, 4, 8]"),
    ({"accelerator": "tpu", "tpu_type": "v6e", "topology": "2x4", "hosts_per_learner": 2},
     "regions.us-east.hosts_per_learner: v6e 2x4 spans 1 host(s) (8 chips each), not 2"),
    ({"topology": "2x2"}, "regions.us-east.topology: only for accelerator: tpu (this region is cpu)"),
    ({"accelerator": "gpu", "tpu_type": "v5p"}, "regions.us-east.tpu_type: only for accelerator: tpu"),
    ({"accelerator": "npu"}, "regions.us-east.accelerator"),
])
def test_config_refusals_name_the_region_and_key(fields, message):
    assert message in refusal(**fields)


def test_multi_host_units_are_accepted_with_their_hosts():
    assert region(accelerator="tpu", tpu_type="v6e", topology="4x4").devices().hosts == 4
    assert region(accelerator="tpu", tpu_type="v5p", topology="2x2x2").devices().hosts == 2
    assert region(accelerator="gpu", hosts_per_learner=2).devices().hosts == 2
    cpu = parse({"regions": {"us-east": {"learners": 2, "hosts_per_learner": 2}}})
    assert cpu.region_resources() == {"region:us-east": 4.0}   # a region unit per host


@pytest.mark.parametrize("top, message", [
    ({"learner": {"sharding": "fsdp"}},
     "learner.sharding: region 'us-east': 'fsdp' with 2 hosts per learner: a multi-host unit "
     "keeps its parameters replicated"),
    ({"health": {"spares": 1}},
     "health.spares: region 'us-east': 1 spare(s) for a region whose units span several hosts"),
])
def test_what_multi_host_units_do_not_do_yet_is_refused_by_key(top, message):
    with pytest.raises(ConfigError) as info:
        parse({"regions": {"us-east": {"learners": 2, "hosts_per_learner": 2}}, **top})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_unit_bundles_and_placement():
    gpu = acc.learner_devices("gpu", 8, 2)
    assert acc.unit_bundle("eu", gpu, 0.25) == {"CPU": 0.25, "region:eu": 1, "GPU": 8}
    assert acc.gang_strategy(gpu, 1) == "PACK" and acc.gang_strategy(gpu, 2) == "STRICT_SPREAD"
    tpu = acc.learner_devices("tpu", tpu_type="v6e", topology="4x4")
    assert acc.gang_strategy(tpu, 1) == "STRICT_SPREAD"   # a slice's hosts are separate VMs
    # 2 units of 2 GPU hosts need 4 nodes' worth of 8 GPUs
    nodes = [{"Alive": True, "Resources": {"region:eu": 2, "GPU": 8}} for _ in range(3)]
    assert acc.region_shortage("eu", 2, gpu, nodes) == (
        "region eu: 2 learners × 2 hosts × 8 GPU need 32 GPU on nodes with region:eu, the "
        "cluster has 24")
    assert acc.region_shortage("eu", 1, gpu, nodes) is None


def test_tpu_slice_request_fits_ray_util_tpu():
    """What the controller asks ``ray.util.tpu.slice_placement_group`` for, bound against its
    real signature (reserving needs TPU nodes, which CI has none of)."""
    import inspect

    from ray.util import tpu as ray_tpu

    devices = acc.learner_devices("tpu", tpu_type="v6e", topology="4x4")
    request = acc.tpu_slice_request(devices, "eu", 0.25, "islands-unit:eu:0:3")
    bound = inspect.signature(ray_tpu.SlicePlacementGroup).bind(**request)
    assert bound.arguments["accelerator_version"] == "v6e"
    assert bound.arguments["topology"] == "4x4"
    assert request["resources_per_bundle"] == {"CPU": 0.25, "region:eu": 1, "TPU": 4}
    # one bundle per host: Ray divides the slice's chips by the bundle's TPU
    assert acc.topology_chips("4x4") // request["resources_per_bundle"]["TPU"] == devices.hosts
    assert ray_tpu.get_chips_per_host("4x4", "v6e") == 4


# -- what a learner asks Ray for, and its environment ----------------------------------------------
def test_learner_options_ask_ray_for_the_devices():
    cpu = learner_options("us-east:0", "us-east", acc.learner_devices("cpu", 4))
    assert cpu["num_cpus"] == 0.25 and "num_gpus" not in cpu
    assert cpu["resources"] == {"region:us-east": 1}
    gpu = learner_options("us-east:0", "us-east", acc.learner_devices("gpu", 0.25))
    assert gpu["num_gpus"] == 0.25 and gpu["resources"] == {"region:us-east": 1}
    tpu = learner_options("eu:1", "eu", acc.learner_devices("tpu", tpu_type="v5p",
                                                            topology="2x2x1"))
    assert tpu["resources"] == {"region:eu": 1, "TPU": 4} and "num_gpus" not in tpu
    assert tpu["name"] == "islands:eu:1"


def test_every_process_gets_its_platform_explicitly():
    """Each role's whole environment is decided, JAX_PLATFORMS included: nothing is left for a
    learner to inherit from the CPU-pinned controller that creates it."""
    for role in (Role.DRIVER, Role.CONTROLLER, Role.SYNCER, Role.LINK_SERVER, Role.REGION_AGENT):
        env = process_env(role, jax_cache_dir="/tmp/cache")
        assert set(env) == set(MANAGED_ENV)
        assert env["JAX_PLATFORMS"] == "cpu" and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
        assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] is None
    gpu = process_env(Role.LEARNER, acc.learner_devices("gpu", 0.5), "/tmp/cache")
    assert gpu["JAX_PLATFORMS"] == "cuda" and gpu["XLA_FLAGS"] is None
    assert gpu["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert gpu["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.45"     # half a card, 0.9 of it
    assert process_env(Role.SPARE, acc.learner_devices("gpu", 2))[
        "XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"              # whole cards: 0.9 of each
    tpu = process_env(Role.UNIT_HOST, acc.learner_devices("tpu", tpu_type="v6e", topology="2x2"))
    assert tpu["JAX_PLATFORMS"] == "tpu" and tpu["XLA_FLAGS"] is None
    four = process_env(Role.LEARNER, acc.learner_devices("cpu", 4))
    assert four["JAX_PLATFORMS"] == "cpu"
    assert four["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=4 "
                                 "--xla_cpu_multi_thread_eigen=false")
    assert process_env(Role.LEARNER)["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=false"
    with pytest.raises(ValueError, match="opens no accelerator"):
        process_env(Role.SYNCER, acc.learner_devices("gpu"))
    # Ray's runtime_env can only set: what must be absent is left out of it.
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in ray_env_vars(process_env(Role.CONTROLLER))


def test_the_service_processes_start_with_two_malloc_arenas_and_the_others_with_the_nodes():
    """The controller and the other long-lived service processes are started with two glibc
    arenas (the controller's memory grew with the job's failures under glibc's default). Every
    other process Ray starts for the job is given the node's own value, which Ray expands at
    the start: a value must be given, because Ray passes the creating controller's env_vars
    on. The driver's environment is the operator's: nothing is decided for it."""
    from islands.orchestrator.runtime import (NODE_MALLOC_ARENAS, controller_options, start_env,
                                              syncer_options)

    assert NODE_MALLOC_ARENAS == "${MALLOC_ARENA_MAX}"
    assert controller_options("/tmp/run")["runtime_env"]["env_vars"]["MALLOC_ARENA_MAX"] == "2"
    assert syncer_options("/tmp/cache")["runtime_env"]["env_vars"]["MALLOC_ARENA_MAX"] == "2"
    for role in (Role.CONTROLLER, Role.SYNCER, Role.LINK_SERVER, Role.REGION_AGENT):
        assert start_env(role) == {"MALLOC_ARENA_MAX": "2"}
    for role in (Role.LEARNER, Role.SPARE, Role.UNIT_HOST):
        assert start_env(role) == {"MALLOC_ARENA_MAX": NODE_MALLOC_ARENAS}
    with pytest.raises(ValueError, match="driver"):
        start_env(Role.DRIVER)
    for role in Role:   # what a process sets itself never touches the allocator
        assert "MALLOC_ARENA_MAX" not in process_env(role)
    for devices in (acc.learner_devices("cpu", 2), acc.learner_devices("gpu", 0.5)):
        options = learner_options("a:0", "a", devices)
        assert options["runtime_env"] == {"env_vars": {"MALLOC_ARENA_MAX": NODE_MALLOC_ARENAS}}


def test_ray_expands_the_nodes_own_value_as_it_starts_a_process(monkeypatch):
    """Ray's own expansion of a runtime_env's env_vars at a worker's start (``update_envs``):
    the node's value where it has one, "" (which glibc reads as unset) where it has none."""
    from ray._private.utils import update_envs

    from islands.orchestrator.runtime import NODE_MALLOC_ARENAS

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    update_envs({"MALLOC_ARENA_MAX": NODE_MALLOC_ARENAS})
    assert os.environ["MALLOC_ARENA_MAX"] == "4"
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    update_envs({"MALLOC_ARENA_MAX": NODE_MALLOC_ARENAS})
    assert os.environ["MALLOC_ARENA_MAX"] == ""


def test_apply_env_replaces_inherited_values_and_removes_what_must_be_absent(monkeypatch):
    from islands.learners.devices import apply_env

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")                 # inherited from the controller
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
    env = process_env(Role.LEARNER, acc.learner_devices("tpu", tpu_type="v6e", topology="2x2"))
    env.pop("JAX_PLATFORMS")   # this process runs JAX on the CPU: leave its platform alone
    apply_env(env)
    assert "XLA_FLAGS" not in os.environ and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ
    assert os.environ["OMP_NUM_THREADS"] == "1"


def test_a_learner_spec_carries_its_regions_environment_and_device_request():
    from islands.orchestrator import fleet as fleet_lib

    config = parse({"regions": {"g": {"learners": 1, "accelerator": "gpu",
                                      "devices_per_host": 0.25},
                                "c": {"learners": 1, "devices_per_host": 2}},
                    "health": {"spares": {"g": 1}}})
    training = build.training_spec(config)
    launches = {a.region: a for a in fleet_lib.step(
        fleet_lib.initial(build.fleet_settings(config)), [], 0.0).actions
        if hasattr(a, "incarnation")}
    gpu = build.learner_spec(config, training, launches["g"], jax_cache_dir="/tmp/cache")
    cpu = build.learner_spec(config, training, launches["c"], jax_cache_dir="/tmp/cache")
    spare = build.spare_spec(config, training, "spare:g:0", "g", jax_cache_dir="/tmp/cache")
    assert gpu.env["JAX_PLATFORMS"] == "cuda" == spare.env["JAX_PLATFORMS"]
    assert gpu.env["JAX_COMPILATION_CACHE_DIR"] == "/tmp/cache"
    assert cpu.env["JAX_PLATFORMS"] == "cpu" and "device_count=2" in cpu.env["XLA_FLAGS"]
    assert gpu.device_request == spare.device_request == DeviceRequest(
        "g", "gpu", 0.25, "num_gpus=0.25")
    assert cpu.device_request == DeviceRequest("c", "cpu", 2, "no accelerator")
    assert build.learner_devices(config, "g") == acc.LearnerDevices("gpu", 0.25, 1)


def test_virtual_cpu_devices_appear_in_jax():
    """The flag gives a fresh process N CPU devices (what the learner's mesh is built over)."""
    import subprocess
    import sys

    env = {**os.environ, **ray_env_vars(process_env(Role.LEARNER, acc.learner_devices("cpu", 3),
                                                    "/tmp/cache"))}
    out = subprocess.run([sys.executable, "-c", "import jax; print(len(jax.local_devices()))"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "3"


def test_region_shortage_counts_devices_on_the_regions_nodes():
    def node(alive=True, **resources):
        return {"Alive": alive, "Resources": resources}

    gpu = acc.learner_devices("gpu", 1)
    nodes = [node(**{"region:us-east": 1, "GPU": 1}), node(**{"region:us-east": 1, "GPU": 1}),
             node(**{"region:eu": 1, "GPU": 8}), node(False, **{"region:us-east": 1, "GPU": 8})]
    assert acc.region_shortage("us-east", 4, gpu, nodes) == (
        "region us-east: 4 learners × 1 GPU need 4 GPU on nodes with region:us-east, the "
        "cluster has 2")
    assert acc.region_shortage("us-east", 2, gpu, nodes) is None
    # Four quarter-GPU learners share one GPU; eight do not fit on two.
    assert acc.region_shortage("us-east", 8, acc.learner_devices("gpu", 0.25), nodes) is None
    two = acc.learner_devices("gpu", 2)
    assert "room for 0 learners: a learner's devices must be on one node" in (
        acc.region_shortage("us-east", 1, two, nodes))
    assert acc.region_shortage("us-east", 4, acc.learner_devices("cpu", 8), nodes) is None


# -- on a real (local) Ray cluster with fake GPUs and TPU chips -----------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=2, resources={"region:a": 4, "TPU": 4},
             namespace="islands", include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


def test_ray_assigns_gpus_and_tpu_chips_to_learners(ray_cluster):
    ray = ray_cluster

    class Probe:   # defined here: Ray ships it by value (workers cannot import this test file)
        def seen(self):
            ids = ray.get_runtime_context().get_accelerator_ids()
            return {"GPU": ids["GPU"], "TPU": ids["TPU"],
                    "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "TPU_VISIBLE_CHIPS": os.environ.get("TPU_VISIBLE_CHIPS")}

    half = acc.learner_devices("gpu", 0.5)
    handles = [ray.remote(Probe).options(**learner_options(f"a:{i}", "a", half)).remote()
               for i in range(2)]
    whole = ray.remote(Probe).options(**learner_options("a:2", "a", acc.learner_devices(
        "gpu", 1))).remote()
    tpu = ray.remote(Probe).options(**learner_options("a:3", "a", acc.learner_devices(
        "tpu", 2, tpu_type="v5e", topology="2x2"))).remote()
    try:
        halves = ray.get([h.seen.remote() for h in handles], timeout=60)
        one = ray.get(whole.seen.remote(), timeout=60)
        chips = ray.get(tpu.seen.remote(), timeout=60)
    finally:
        for h in handles + [whole, tpu]:
            ray.kill(h)
    # The two half-GPU learners share one GPU; the whole-GPU learner gets the other.
    assert halves[0]["GPU"] == halves[1]["GPU"] and len(halves[0]["GPU"]) == 1
    assert halves[0]["CUDA_VISIBLE_DEVICES"] == halves[0]["GPU"][0]
    assert one["GPU"] != halves[0]["GPU"] and one["CUDA_VISIBLE_DEVICES"] == one["GPU"][0]
    assert len(chips["TPU"]) == 2 and chips["TPU_VISIBLE_CHIPS"] == ",".join(chips["TPU"])
    assert chips["GPU"] == [] and not chips["CUDA_VISIBLE_DEVICES"]


def test_capacity_check_names_the_region_short_of_devices(ray_cluster):
    from islands.orchestrator.job import check_capacity

    fits = parse({"regions": {"a": {"learners": 4, "accelerator": "gpu", "devices_per_host": 0.5}}})
    check_capacity(fits)
    short = parse({"regions": {"a": {"learners": 3, "accelerator": "gpu"}}})
    with pytest.raises(RuntimeError, match=re.escape(
            "region a: 3 learners × 1 GPU need 3 GPU on nodes with region:a, the cluster has 2")):
        check_capacity(short)
    tpu = parse({"regions": {"a": {"learners": 3, "accelerator": "tpu", "tpu_type": "v5e",
                                   "topology": "2x2", "devices_per_host": 2}}})
    with pytest.raises(RuntimeError, match="region a: 3 learners × 2 TPU need 6 TPU"):
        check_capacity(tpu)
    missing = parse({"regions": {"b": {"learners": 1, "accelerator": "gpu"}}})
    with pytest.raises(RuntimeError, match="region 'b' needs 1 'region:b' resources"):
        check_capacity(missing)
