"""trainer.runtime.cluster: the NCCL and EFA variables a host of a SageMaker job gets from resourceconfig.json."""

import json
import os
from unittest import mock

from trainer import container
from trainer.runtime import cluster

NETWORK_VARIABLES = ("NCCL_SOCKET_IFNAME", "FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "RDMAV_FORK_SAFE")


def resources(instance_type: str, interface: str = "eth0") -> dict:
    """resourceconfig.json of algo-2 of a two-host job, as SageMaker writes it."""
    return {"current_host": "algo-2", "current_instance_type": instance_type, "current_group_name": "homogeneousCluster",
            "hosts": ["algo-1", "algo-2"], "network_interface_name": interface}


def test_an_efa_instance_with_gpudirect_rdma_gets_the_interface_the_efa_provider_and_rdma():
    assert cluster.network_environment(resources("ml.p4d.24xlarge"), {}, {"lo", "eth0"}) == {
        "NCCL_SOCKET_IFNAME": "eth0", "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "RDMAV_FORK_SAFE": "1"}


def test_an_efa_instance_without_rdma_gets_the_efa_provider_only():
    assert cluster.network_environment(resources("ml.g5.48xlarge"), {}, {"lo", "eth0"}) == {
        "NCCL_SOCKET_IFNAME": "eth0", "FI_PROVIDER": "efa"}


def test_an_instance_without_efa_gets_the_socket_interface_only():
    assert cluster.network_environment(resources("ml.g5.12xlarge"), {}, {"lo", "eth0"}) == {"NCCL_SOCKET_IFNAME": "eth0"}


def test_variables_the_job_already_set_are_kept():
    user_set = {"NCCL_SOCKET_IFNAME": "ens5", "FI_EFA_USE_DEVICE_RDMA": "0"}
    assert cluster.network_environment(resources("ml.p5.48xlarge"), user_set, {"lo", "eth0", "ens5"}) == {
        "FI_PROVIDER": "efa", "RDMAV_FORK_SAFE": "1"}


def test_an_interface_this_machine_lacks_is_not_named():
    # the local stack writes SageMaker's eth0 whatever the machine's interfaces are called
    assert cluster.network_environment(resources("ml.g5.xlarge"), {}, {"lo", "enp5s0"}) == {}


def test_resourceconfig_without_network_fields_adds_nothing():
    assert cluster.network_environment({"current_host": "algo-1", "hosts": ["algo-1"]}, {}, {"lo", "eth0"}) == {}


def test_the_container_exports_them_for_torchrun_and_keeps_what_the_job_set(tmp_path, monkeypatch):
    config = tmp_path / "input" / "config"
    config.mkdir(parents=True)
    (config / "resourceconfig.json").write_text(json.dumps(resources("ml.p4de.24xlarge")))
    monkeypatch.setattr(cluster, "network_interfaces", lambda: {"lo", "eth0"})
    # the job's Environment set FI_PROVIDER; mock.patch.dict restores os.environ, SM_* included
    clean = {name: value for name, value in os.environ.items() if name not in NETWORK_VARIABLES}
    with mock.patch.dict(os.environ, {**clean, "FI_PROVIDER": "tcp"}, clear=True):
        container.prepare_job(tmp_path)
        exported = {name: os.environ.get(name) for name in NETWORK_VARIABLES}
        host = os.environ["SM_CURRENT_HOST"]
    assert exported == {"NCCL_SOCKET_IFNAME": "eth0", "FI_PROVIDER": "tcp", "FI_EFA_USE_DEVICE_RDMA": "1",
                        "RDMAV_FORK_SAFE": "1"}
    assert host == "algo-2"


def test_the_host_is_the_one_resourceconfig_names(monkeypatch):
    monkeypatch.setenv("SM_CURRENT_HOST", "algo-3")
    assert cluster.host_name() == "algo-3"
