"""Start the pipeline's training job by hand, from a notebook or a terminal:
the same request the StartTrainingFunction builds (core.start_training.job_requests.training_job_request), sent with
the SageMaker Python SDK, whose session then streams the job's CloudWatch logs.

    pip install -e ".[functions,launch]"   # from a checkout: the request builder is functions/core
    python -m trainer.launch --manifest s3://<data>/manifests/<job>.manifest --job-name my-run-1 \\
        --settings-from-function <deployed StartTrainingFunction name> [--stage 0] [--steps 1000] [--wait]

`--settings-from-function` reads the deployed function's environment, and the stack's current recipe
(core.recipes: the hyperparameters and the run plan), so instance types, quota, role, image, checkpoints
and hyperparameters are exactly the pipeline's; `--env-json FILE` takes the variables from a file instead
(e.g. for a stack you cannot read).

This runs on an operator's machine, never in the image (no module the image runs imports it): it
alone under trainer/ imports the Lambda-side `core`, so that the request is the function's own, not
a copy (tests/trainer/test_imports.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# functions/core and functions/contracts, installed as `core` and `contracts` by pyproject.toml
from contracts import pipeline_table
from contracts.messages import Manifest
from core.start_training.settings import TrainingSettings
from core.start_training.job_requests import training_job_request


def settings_from(args: argparse.Namespace, boto_session: Any) -> TrainingSettings:
    if args.env_json:
        return TrainingSettings.current(json.loads(Path(args.env_json).read_text()))
    configuration = boto_session.client("lambda").get_function_configuration(FunctionName=args.settings_from_function)
    return TrainingSettings.current(configuration["Environment"]["Variables"])


def rich_manifest_uri(manifest_uri: str) -> str:
    """The rich manifest the pipeline writes beside the ManifestFile (`<job>.json`)."""
    return manifest_uri.removesuffix(".manifest") + ".json"


def read_manifest(manifest_uri: str, boto_session: Any) -> Manifest:
    bucket, key = rich_manifest_uri(manifest_uri).removeprefix("s3://").split("/", 1)
    body = boto_session.client("s3").get_object(Bucket=bucket, Key=key)["Body"]
    return Manifest.model_validate_json(body.read())


def build_request(args: argparse.Namespace, settings: TrainingSettings, manifest: Manifest) -> dict[str, Any]:
    """Exactly the pipeline's request for this manifest and run-plan job, with its exclusion list (takedowns,
    license terms) as the `manifest` channel when it has one, so a job started by hand skips what the
    pipeline's would."""
    steps = args.steps or settings.run_plan[args.stage].steps
    exclusions_uri = rich_manifest_uri(args.manifest) if manifest.exclude else ""
    first_step = max(1, steps - settings.run_plan[args.stage].steps + 1)  # the run-plan job's warm-up counts from there
    return training_job_request(args.job_name, args.manifest, manifest.digest, args.stage, steps, settings,
                                exclusions_uri, vae_uri=args.vae_uri, first_step=first_step,
                                tokenizer_uri=getattr(args, "tokenizer_uri", None) or "")


def lineage_vae(settings: TrainingSettings, boto_session: Any, attribute: str = "vae_uri") -> str:
    """The VAE the lineage trained itself (its autoencoder job's model.tar.gz), "" if it has none; with
    `attribute="tokenizer_uri"`, its tokenizer job's."""
    key = {"pk": {"S": pipeline_table.lineage_pk(settings.lineage)}}
    item = boto_session.client("dynamodb").get_item(TableName=settings.table, Key=key,
                                                    ProjectionExpression=attribute).get("Item", {})
    return item.get(attribute, {}).get("S", "")


def launch(args: argparse.Namespace) -> dict[str, Any]:
    import sagemaker  # the `launch` extra: the SDK is not needed anywhere else

    session = sagemaker.Session()
    settings = settings_from(args, session.boto_session)
    if args.vae_uri is None:  # as the pipeline's job would: the lineage's own VAE, when it trained one
        args.vae_uri = lineage_vae(settings, session.boto_session)
    if args.tokenizer_uri is None:  # and its own tokenizers, when a tokenizer job learned them
        args.tokenizer_uri = lineage_vae(settings, session.boto_session, "tokenizer_uri")
    request = build_request(args, settings, read_manifest(args.manifest, session.boto_session))
    session.sagemaker_client.create_training_job(**request)
    print(f"started {args.job_name}: {request['ResourceConfig']['InstanceCount']} x "
          f"{request['ResourceConfig']['InstanceType']}", flush=True)
    if args.wait:
        session.logs_for_job(args.job_name, wait=True)  # streams the job's logs until it ends
    return request


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", required=True, help="s3:// URI of a SageMaker ManifestFile (manifests/<job>.manifest)")
    parser.add_argument("--job-name", required=True, help="unique per account and region, at most 63 characters")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--settings-from-function", help="the deployed StartTrainingFunction's name")
    source.add_argument("--env-json", help="a JSON file of the StartTrainingFunction's variables")
    parser.add_argument("--stage", type=int, default=0, help="which run-plan job to run (its index)")
    parser.add_argument("--steps", type=int, default=0, help="the lineage step total to train to, the run-plan job's steps being "
                        "its last (default: the job's)")
    parser.add_argument("--vae-uri", default=None,
                        help="the VAE channel: an autoencoder job's model.tar.gz (default: the lineage's own, read "
                             "from the pipeline table, if it trained one; '' for none)")
    parser.add_argument("--tokenizer-uri", default=None,
                        help="the tokenizer channel: a tokenizer job's model.tar.gz (default: the lineage's own, as for "
                             "--vae-uri; '' for none)")
    parser.add_argument("--wait", action="store_true", help="stream the job's logs until it ends")
    return parser.parse_args(argv)


if __name__ == "__main__":
    launch(parse_args())
