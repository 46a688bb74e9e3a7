"""Where this process runs in a SageMaker cluster, and the network settings NCCL needs there.

A SageMaker framework image's training toolkit exports NCCL's and libfabric's variables before it
starts the script; this image runs `trainer.container` instead, so nothing else sets them and NCCL
and libfabric would pick an interface and a provider by themselves. From resourceconfig.json's
`network_interface_name` and `current_instance_type` (docs/trainer.md, "Multi-node on SageMaker",
gives the sources):

- `NCCL_SOCKET_IFNAME`: the interface SageMaker names, for NCCL's bootstrap and socket traffic;
- `FI_PROVIDER=efa` on an instance type with EFA, so aws-ofi-nccl's libfabric takes the EFA device;
- `FI_EFA_USE_DEVICE_RDMA=1` and `RDMAV_FORK_SAFE=1` where that EFA does GPUDirect RDMA.

A variable already set (the training job's `Environment`, or the image) is left as it is.
"""

import os
import socket
from collections.abc import Collection, Mapping

# SageMaker training instance types with EFA, and whether it does GPUDirect RDMA (libfabric aborts
# when FI_EFA_USE_DEVICE_RDMA=1 is set on a device without it). The SageMaker Python SDK's lists
# (SM_EFA_NCCL_INSTANCES, SM_EFA_RDMA_INSTANCES; its torchrun driver sets these variables from them)
# with the P5 family completed: p5, p5e and p5en have RDMA, which the SDK's lists miss
# (aws/sagemaker-python-sdk#5491). Trainium (trn1.32xlarge, trn1n.32xlarge) is left out: this CUDA
# image does not run there.
EFA_INSTANCE_TYPES: dict[str, bool] = {
    "ml.g4dn.8xlarge": False,
    "ml.g4dn.12xlarge": False,
    "ml.g5.48xlarge": False,
    "ml.p3dn.24xlarge": False,
    "ml.p4d.24xlarge": True,
    "ml.p4de.24xlarge": True,
    "ml.p5.48xlarge": True,
    "ml.p5e.48xlarge": True,
    "ml.p5en.48xlarge": True,
}


def host_name() -> str:
    """This host as resourceconfig.json names it (`algo-N`, exported by trainer.container), else the machine's."""
    return os.environ.get("SM_CURRENT_HOST") or socket.gethostname()


def network_interfaces() -> set[str]:
    """The network interfaces this machine has."""
    return {name for _, name in socket.if_nameindex()}


def network_environment(resources: dict, environ: Mapping[str, str], interfaces: Collection[str]) -> dict[str, str]:
    """The NCCL and EFA variables to add for this host of the job (those `environ` lacks)."""
    wanted = {}
    interface = resources.get("network_interface_name")
    # The local stack writes SageMaker's `eth0` on machines that may have no such interface, where
    # NCCL would find none to bootstrap on; there NCCL's own choice is the better one.
    if interface in interfaces:
        wanted["NCCL_SOCKET_IFNAME"] = interface
    instance_type = resources.get("current_instance_type")
    if instance_type in EFA_INSTANCE_TYPES:
        wanted["FI_PROVIDER"] = "efa"
        if EFA_INSTANCE_TYPES[instance_type]:
            wanted["FI_EFA_USE_DEVICE_RDMA"] = "1"
            # DataLoader workers fork after NCCL registered memory with the device (the preflight's all-reduce)
            wanted["RDMAV_FORK_SAFE"] = "1"
    return {name: value for name, value in wanted.items() if name not in environ}
