"""Paths inside a SageMaker training container that the job request and the trainer both name.

The request sets them (CheckpointConfig.LocalPath, TensorBoardOutputConfig.LocalPath); the trainer
writes there. Both are SageMaker's defaults, spelled out so a request never leaves them implicit.
"""

from __future__ import annotations

CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"  # synced to CheckpointConfig.S3Uri while the job runs
TENSORBOARD_LOCAL_PATH = "/opt/ml/output/tensorboard"  # uploaded to TensorBoardOutputConfig.S3OutputPath
