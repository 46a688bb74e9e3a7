"""Facts about SageMaker instance types that requests depend on, in one table each.

Instance store: "Certain Nitro-based instances include local storage ... You can't request a
VolumeKmsKeyId when using an instance type with local storage" (SageMaker API reference,
ResourceConfig.VolumeKmsKeyId; the same for CreateEndpointConfig's KmsKeyId, whose call "fails").
Those volumes are encrypted by the instance's hardware module instead. The families are EC2's
"Instance store volume limits for EC2 instances" list, restricted to those SageMaker offers as
`ml.<family>.<size>` (docs/aws-differences.md).
"""

from __future__ import annotations

import re

# NVMe instance store on every size of the family.
INSTANCE_STORE_FAMILIES: frozenset[str] = frozenset({
    "c5d", "m5d", "r5d", "c6id", "m6id", "r6id",  # general purpose, compute, memory: the "d" variants
    "g4dn", "g4ad", "g5", "g6", "g6e", "gr6",
    "p3dn", "p4d", "p4de", "p5", "p5e", "p5en", "p6-b200",
    "trn1", "trn1n", "trn2", "dl1",
})

# GPUs per instance of the types a run plan names; others count as one training process.
GPUS_PER_INSTANCE: dict[str, int] = {
    "ml.p5.48xlarge": 8, "ml.p5e.48xlarge": 8, "ml.p5en.48xlarge": 8, "ml.p4d.24xlarge": 8,
    "ml.p4de.24xlarge": 8, "ml.g5.48xlarge": 8, "ml.g6e.48xlarge": 8, "ml.g5.24xlarge": 4,
    "ml.g5.12xlarge": 4, "ml.g6e.24xlarge": 4, "ml.g6e.12xlarge": 4, "ml.p3.16xlarge": 8, "ml.p3.8xlarge": 4,
}

# NVIDIA GPUs (CUDA) on every size of the family; g4ad's are AMD's, trn/inf are AWS's own chips.
CUDA_FAMILIES: frozenset[str] = frozenset({
    "p3", "p3dn", "p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "g4dn", "g5", "g5g", "g6", "g6e", "gr6",
})

_TYPE = re.compile(r"ml\.(?P<family>[a-z0-9-]+)\.(?P<size>[a-z0-9]+)")


def family(instance_type: str) -> str:
    """'ml.p4d.24xlarge' -> 'p4d'; ValueError for a name that is not a SageMaker instance type."""
    found = _TYPE.fullmatch(instance_type)
    if not found:
        raise ValueError(f"not a SageMaker instance type (ml.<family>.<size>): {instance_type!r}")
    return found["family"]


def has_cuda(instance_type: str) -> bool:
    """Whether the type's accelerators are NVIDIA GPUs (what CUDA graphs, bf16 autocast on CUDA, ... need)."""
    return family(instance_type) in CUDA_FAMILIES


def has_instance_store(instance_type: str) -> bool:
    """Whether the type's volumes are instance store, for which AWS refuses a KMS key in the request."""
    return family(instance_type) in INSTANCE_STORE_FAMILIES
