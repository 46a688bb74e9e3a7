"""Start-training stage: sealed shards at the quota become SageMaker jobs of one lineage."""
