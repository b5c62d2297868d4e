"""`torch_xla._internal.tpu`: TPU host facts from mocked metadata, variables and PCI files."""
from __future__ import annotations

import os
import urllib.error
from unittest import mock

import pytest

from torch_xla._internal import tpu

V4_16_METADATA = """
ACCELERATOR_TYPE: 'v4-16'
CHIPS_PER_HOST_BOUNDS: '2,2,1'
HOST_BOUNDS: '1,1,2'
TPU_CHIPS_PER_PROCESS_BOUNDS: '2,2,1'
TPU_PROCESS_BOUNDS: '1,1,2'
ZONE: "us-central2-b"
WORKER_ID: '1'
"""


@pytest.fixture
def clean_env():
    with mock.patch.dict(os.environ, {}, clear=True):
        yield


def _metadata(**attrs):
    return mock.patch.object(tpu, "_get_metadata", side_effect=lambda key: attrs[key.replace("-", "_")])


def test_mesh_shape():
    m = tpu.MeshShape.from_string("2,2,1")
    assert m == (2, 2, 1) and m.size == 4
    assert m * tpu.MeshShape(1, 1, 2) == (2, 2, 2)
    with pytest.raises(ValueError, match="should be length 3"):
        tpu.MeshShape.from_string("2,2")


@pytest.mark.parametrize("bounds,want", [(None, None), ("1,1,1", 1), ("2,2,2", 8)])
def test_process_bounds_size(clean_env, bounds, want):
    if bounds:
        os.environ["TPU_PROCESS_BOUNDS"] = bounds
    assert tpu.process_bounds_size() == want


@pytest.mark.parametrize("n", [0, 1, 4])
def test_num_available_chips_from_pci(tmp_path, n):
    # Other vendors' devices and Google devices that are not TPUs do not count.
    devices = [("0x8086", "0x1234"), ("0x1ae0", "0x9999")] + [("0x1ae0", "0x005e")] * n
    vendor_files = []
    for i, (vendor, device) in enumerate(devices):
        d = tmp_path / f"0000:00:0{i}.0"
        d.mkdir()
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
        vendor_files.append(str(d / "vendor"))
    with mock.patch("glob.glob", return_value=vendor_files) as g:
        assert tpu.num_available_chips() == n
    g.assert_called_once_with("/sys/bus/pci/devices/*/vendor")


@pytest.mark.parametrize("version,chips,want", [(2, 4, 8), (3, 4, 8), (4, 4, 4), (5, 1, 1)])
def test_num_available_devices(version, chips, want):
    with mock.patch.object(tpu, "version", return_value=version), \
            mock.patch.object(tpu, "num_available_chips", return_value=chips):
        assert tpu.num_available_devices() == want
        with mock.patch.object(tpu, "get_worker_ips", return_value=["a", "b"]):
            assert tpu.num_expected_global_devices() == 2 * want


@pytest.mark.parametrize("bounds,chips,want", [(None, 4, 4), ("1,1,1", 4, 1), ("2,2,2", 4, 4), (None, 1, 1)])
def test_num_local_processes(clean_env, bounds, chips, want):
    if bounds:
        os.environ["TPU_PROCESS_BOUNDS"] = bounds
    with mock.patch.object(tpu, "num_available_chips", return_value=chips):
        assert tpu.num_local_processes() == want


def test_task_id(clean_env):
    assert tpu.task_id() is None
    os.environ["CLOUD_TPU_TASK_ID"] = "15"
    assert tpu.task_id() == 15


def test_tpu_env_from_metadata(clean_env):
    with _metadata(tpu_env=V4_16_METADATA):
        env = tpu.get_tpu_env()
        assert env["ACCELERATOR_TYPE"] == "v4-16" and env["ZONE"] == "us-central2-b"
        assert env["TPU_PROCESS_BOUNDS"] == "1,1,2" and env["WORKER_ID"] == "1"
        assert tpu.worker_id() == 1
        assert tpu.version() == 4
        assert tpu.get_tpu_type() == "v4"


@pytest.mark.parametrize("acc,version,kind", [("v2-8", 2, "v2"), ("v5litepod-16", 5, "v5litepod"),
                                              ("v6e-8", 6, "v6e"), ("tpu7x-8", 7, "tpu7x")])
def test_version_and_type(acc, version, kind):
    with mock.patch.object(tpu, "get_tpu_env", return_value={"ACCELERATOR_TYPE": acc}):
        assert tpu.version() == version
        assert tpu.get_tpu_type() == kind


def test_version_errors():
    with mock.patch.object(tpu, "get_tpu_env", return_value={"ACCELERATOR_TYPE": "gpu-8"}):
        with pytest.raises(EnvironmentError, match="Failed to parse TPU version"):
            tpu.version()
    with mock.patch.object(tpu, "get_tpu_env", side_effect=urllib.error.URLError("no route")):
        with pytest.raises(EnvironmentError, match="Failed to get TPU metadata"):
            tpu.version()


def test_get_metadata_request():
    class Resp:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def read(self):
            return b"ACCELERATOR_TYPE: 'v4-8'\n"

    with mock.patch("urllib.request.urlopen", return_value=Resp()) as op:
        assert tpu._get_metadata("tpu-env") == "ACCELERATOR_TYPE: 'v4-8'\n"
    req = op.call_args.args[0]
    assert req.full_url == "http://metadata.google.internal/computeMetadata/v1/instance/attributes/tpu-env"
    assert req.get_header("Metadata-flavor") == "Google"


def test_tpu_env_from_variables(clean_env):
    os.environ.update({"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v4-16", "TPU_HOST_BOUNDS": "1,1,2",
                       "TPU_CHIPS_PER_HOST_BOUNDS": "2,1,1", "TPU_WORKER_ID": "0",
                       "TPU_WORKER_HOSTNAMES": "h0,h1"})
    with mock.patch.object(tpu, "_get_metadata", side_effect=AssertionError("no metadata query")):
        assert tpu.get_tpu_env() == {"ACCELERATOR_TYPE": "v4-16", "TPU_PROCESS_BOUNDS": "1,1,2",
                                     "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,1,1", "WORKER_ID": "0"}
        # per-process values win over the per-host ones
        os.environ.update({"TPU_PROCESS_BOUNDS": "1,2,2", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
                           "CLOUD_TPU_TASK_ID": "1"})
        assert tpu.get_tpu_env() == {"ACCELERATOR_TYPE": "v4-16", "TPU_PROCESS_BOUNDS": "1,2,2",
                                     "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "WORKER_ID": "1"}
        assert tpu.get_worker_ips() == ["h0", "h1"]
        assert tpu.num_tpu_workers() == 2


def test_skip_flag_alone_on_a_host_without_chips(clean_env):
    # jax's import sets TPU_SKIP_MDS_QUERY=1 on such hosts: it names no TPU.
    os.environ["TPU_SKIP_MDS_QUERY"] = "1"
    with mock.patch.object(tpu, "num_available_chips", return_value=0), \
            _metadata(worker_network_endpoints="w-0:1:10.0.0.5,w-1:2:10.0.0.6"):
        assert tpu.get_worker_ips() == ["10.0.0.5", "10.0.0.6"]
    with mock.patch.object(tpu, "num_available_chips", return_value=4), \
            mock.patch.object(tpu, "_get_metadata", side_effect=AssertionError("no metadata query")):
        os.environ["TPU_WORKER_HOSTNAMES"] = "h0"
        assert tpu.get_worker_ips() == ["localhost"]


@pytest.mark.parametrize("endpoints,want", [
    ("t1v-n-1-w-0:12345:10.130.0.31", ["localhost"]),
    ("w-0:1:10.0.0.2,w-1:2:10.0.0.1,w-2:3:10.0.0.3", ["10.0.0.2", "10.0.0.1", "10.0.0.3"])])
def test_worker_ips_from_metadata(clean_env, endpoints, want):
    with _metadata(worker_network_endpoints=endpoints):
        assert tpu.get_worker_ips() == want


@pytest.mark.parametrize("tpu_env,ips,rank,want", [
    ({"ACCELERATOR_TYPE": "v4-8", "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
      "WORKER_ID": "0"}, ["localhost"], 3,
     {"TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "2,2,1", "CLOUD_TPU_TASK_ID": "3",
      "TPU_PROCESS_PORT": "8479", "TPU_VISIBLE_CHIPS": "3",
      "TPU_PROCESS_ADDRESSES": "localhost:8476,localhost:8477,localhost:8478,localhost:8479"}),
    ({"ACCELERATOR_TYPE": "v4-16", "TPU_PROCESS_BOUNDS": "1,1,2", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
      "WORKER_ID": "1"}, ["10.0.0.1", "10.0.0.2"], 1,
     {"TPU_PROCESS_BOUNDS": "2,2,2", "CLOUD_TPU_TASK_ID": "5", "TPU_PROCESS_PORT": "8477", "TPU_VISIBLE_CHIPS": "1",
      "TPU_PROCESS_ADDRESSES": ",".join(f"10.0.0.{h}:{p}" for h in (1, 2) for p in range(8476, 8480))}),
    ({"ACCELERATOR_TYPE": "v3-32", "WORKER_ID": "2"}, ["a", "b", "c", "d"], 0,
     {"TPU_PROCESS_BOUNDS": "4,4,1", "CLOUD_TPU_TASK_ID": "8", "TPU_PROCESS_PORT": "8476"}),
    ({"ACCELERATOR_TYPE": "tpu7x-8", "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
      "WORKER_ID": "0"}, ["localhost"], 0, {"TPU_PROCESS_BOUNDS": "2,2,1,2"}),
])
def test_configure_topology(clean_env, tpu_env, ips, rank, want):
    with mock.patch.object(tpu, "get_tpu_env", return_value=tpu_env), \
            mock.patch.object(tpu, "get_worker_ips", return_value=ips):
        tpu.configure_topology(rank, 4)
        assert {k: os.environ.get(k) for k in want} == want


def test_configure_keeps_what_is_set(clean_env):
    os.environ["TPU_VISIBLE_CHIPS"] = "2"
    tpu.configure_one_chip_topology()
    assert (os.environ["TPU_VISIBLE_CHIPS"], os.environ["TPU_CHIPS_PER_PROCESS_BOUNDS"],
            os.environ["TPU_PROCESS_BOUNDS"]) == ("2", "1,1,1", "1,1,1")


def test_master_ip_of_one_host():
    with mock.patch.object(tpu, "get_worker_ips", return_value=["localhost"]):
        assert tpu.discover_master_worker_ip() == "localhost"
