"""trainer.jobs.train's arguments: the container paths (defaults from the SageMaker environment: SM_CHANNEL_TRAIN,
SM_MODEL_DIR, SM_OUTPUT_DATA_DIR, SM_CHANNEL_INDEXES, SM_CHANNEL_MANIFEST), then every option of the recipe
(contracts.recipe.TrainOptions: its type, default, help and the checks that fail a job before it starts), with
SM_HPS's values as the defaults when it is set. docs/trainer.md's "Arguments" lists them.
"""

import argparse
import json
import os

from contracts import recipe
from contracts.recipe import WHERE, TrainOptions
from trainer.jobs.hyperparameters import add_options, checked


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(description="Train a latent-diffusion UNet on Atelier shards.")
    where = parser.add_argument_group(WHERE)  # contracts.recipe.TRAIN_PATHS: not recipe fields
    where.add_argument("--train-dir", default=env.get("SM_CHANNEL_TRAIN"), required="SM_CHANNEL_TRAIN" not in env,
                       help="directory with the *.tar shards, at any depth (default $SM_CHANNEL_TRAIN)")
    where.add_argument("--model-dir", default=env.get("SM_MODEL_DIR"), required="SM_MODEL_DIR" not in env,
                       help="where the pipeline is saved (default $SM_MODEL_DIR)")
    where.add_argument("--output-data-dir", default=env.get("SM_OUTPUT_DATA_DIR"),
                       help="loss curve and validation grids (default $SM_OUTPUT_DATA_DIR, else <model-dir>/health)")
    where.add_argument("--checkpoint-dir", default=None,
                       help="checkpoints go here; none are written without it (SageMaker: /opt/ml/checkpoints)")
    where.add_argument("--index-dir", default=env.get("SM_CHANNEL_INDEXES"),
                       help="the shards' sample tables (default $SM_CHANNEL_INDEXES, else <train-dir>/indexes)")
    where.add_argument("--manifest", default=env.get("SM_CHANNEL_MANIFEST"),
                       help="the job's manifest JSON (or the channel dir holding it): its `exclude` samples are never "
                            "read (default $SM_CHANNEL_MANIFEST)")
    add_options(parser, TrainOptions)
    # Inside a SageMaker training-toolkit image the hyperparameters arrive as SM_HPS, all strings;
    # argparse converts string defaults with each argument's type.
    hyperparameters = json.loads(env.get("SM_HPS", "{}"))
    if recipe.unknown_refusal(hyperparameters):  # set_defaults would keep a misspelt name as an attribute nothing reads
        unknown = [f"--{name} {value}" for name, value in hyperparameters.items()
                   if recipe.unknown_refusal([name])]
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # argparse's words for the same on the command line
    parser.set_defaults(**{
        name.replace("-", "_"): str(value)
        for name, value in hyperparameters.items()
        if not name.startswith("sagemaker_")  # the SageMaker SDK's own settings, not ours
    })
    return checked(parser, TrainOptions, parser.parse_args(argv))
