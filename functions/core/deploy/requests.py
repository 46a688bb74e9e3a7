"""The SageMaker requests of the deploy stage, pure: a candidate's model and endpoint config, the
blue/green deployment config, and its evaluation job."""

from __future__ import annotations

from typing import Any

from contracts import c2pa_secret, job_tags, s3_layout
from core.deploy.events import CANDIDATE_TAG, EVAL_SUFFIX, MANIFEST_TAG, ROLE_TAG, TRAINING_JOB_TAG, JobState
from core.deploy.settings import DeploySettings
from core.start_training.instance_types import has_instance_store
from core.start_training.job_requests import encrypt_with_key

VARIANT = "AllTraffic"


def model_name_for(job: JobState) -> str:
    """The training job's name: it carries the manifest hash, and each job yields one model."""
    return job.name


def model_request(job: JobState, settings: DeploySettings) -> dict[str, Any]:
    manifest = job.tag_map.get(MANIFEST_TAG, "")
    signing = {c2pa_secret.ENVIRONMENT: settings.signing_secret_arn} if settings.signing_secret_arn else {}
    return {
        "ModelName": model_name_for(job),
        "ExecutionRoleArn": settings.role_arn,
        "PrimaryContainer": {
            "Image": settings.image_uri, "ModelDataUrl": job.model_data_url,
            # the operator's server settings, then what every generated PNG carries (trainer/serve/settings.py)
            "Environment": {**settings.serve_environment,
                            "ATELIER_MODEL_ID": model_name_for(job), "ATELIER_MANIFEST_DIGEST": manifest,
                            "ATELIER_ATTRIBUTION_URI": attribution_uri(job, settings), **signing},
        },
        # An isolated container gets no AWS credentials and no network (SageMaker, "Network isolation"):
        # one that signs reads its secret at start, so only it runs without (docs/deploy.md)
        "EnableNetworkIsolation": not signing,
        "Tags": [{"Key": TRAINING_JOB_TAG, "Value": job.name}, {"Key": MANIFEST_TAG, "Value": manifest}],
    }


def attribution_uri(job: JobState, settings: DeploySettings) -> str:
    """Where the start-training stage writes the model's attribution report (docs/provenance.md)."""
    return s3_layout.output_uri(settings.models_bucket, job.name, s3_layout.ATTRIBUTION_FILE)


def endpoint_config_request(job: JobState, settings: DeploySettings) -> dict[str, Any]:
    request: dict[str, Any] = {
        "EndpointConfigName": model_name_for(job),
        "ProductionVariants": [{
            "VariantName": VARIANT, "ModelName": model_name_for(job),
            "InstanceType": settings.instance_type, "InitialInstanceCount": settings.min_instances,
            # AWS: 60..3600 s; the server answers /ping 200 only once its compiled graphs are warm
            "ContainerStartupHealthCheckTimeoutInSeconds": settings.startup_timeout_s,
        }],
        "Tags": [{"Key": TRAINING_JOB_TAG, "Value": job.name}],
    }
    if settings.kms_key and not has_instance_store(settings.instance_type):  # AWS refuses the key there
        request["KmsKeyId"] = settings.kms_key
    return request


def deployment_config(settings: DeploySettings) -> dict[str, Any]:
    """Blue/green with a baking period, rolled back when any of the endpoint's alarms fires."""
    routing: dict[str, Any] = {"Type": settings.traffic_routing, "WaitIntervalInSeconds": settings.wait_interval_s}
    if settings.traffic_routing == "CANARY":
        routing["CanarySize"] = {"Type": "CAPACITY_PERCENT", "Value": settings.canary_percent}
    elif settings.traffic_routing == "LINEAR":
        routing["LinearStepSize"] = {"Type": "CAPACITY_PERCENT", "Value": settings.canary_percent}
    config: dict[str, Any] = {"BlueGreenUpdatePolicy": {
        "TrafficRoutingConfiguration": routing,
        "TerminationWaitInSeconds": settings.bake_s,
        "MaximumExecutionTimeoutInSeconds": settings.max_rollout_s,
    }}
    if settings.rollback_alarms:
        config["AutoRollbackConfiguration"] = {"Alarms": [{"AlarmName": a} for a in settings.rollback_alarms]}
    return config


def evaluation_job_name(model: str, attempt: int = 0) -> str:
    return f"{model}{EVAL_SUFFIX}" if attempt == 0 else f"{model}-ev{attempt}"


def evaluation_job_request(name: str, candidate: dict[str, Any], production: dict[str, Any] | None,
                           settings: DeploySettings) -> dict[str, Any]:
    """The training image with task=evaluate on the held-out set (trainer/jobs/evaluate.py)."""
    channels = [_channel("candidate", candidate["model_data"]), _channel("eval", settings.eval_data_uri)]
    if production:
        channels.append(_channel("baseline", production["model_data"]))
    if settings.clip_model_uri:
        channels.append(_channel("clip", settings.clip_model_uri))
    request: dict[str, Any] = {
        "TrainingJobName": name,
        "RoleArn": settings.role_arn,
        "AlgorithmSpecification": {"TrainingImage": settings.training_image_uri, "TrainingInputMode": "File"},
        "HyperParameters": {**settings.eval_hyperparameters, "task": "evaluate"},
        "InputDataConfig": channels,
        "OutputDataConfig": {"S3OutputPath": s3_layout.uri(settings.models_bucket, s3_layout.EVALUATIONS)},
        "ResourceConfig": {"InstanceType": settings.eval_instance_type, "InstanceCount": 1, "VolumeSizeInGB": 50},
        "StoppingCondition": {"MaxRuntimeInSeconds": settings.max_eval_runtime_s},
        "EnableNetworkIsolation": True,
        "EnableInterContainerTrafficEncryption": True,
        "Tags": [{"Key": ROLE_TAG, "Value": job_tags.EVALUATION}, {"Key": CANDIDATE_TAG, "Value": candidate["model"]},
                 {"Key": job_tags.BASELINE, "Value": production["model"] if production else ""}],
    }
    encrypt_with_key(request, settings.kms_key)
    return request


def _channel(name: str, uri: str) -> dict[str, Any]:
    return {"ChannelName": name, "InputMode": "File",
            "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": uri,
                                            "S3DataDistributionType": "FullyReplicated"}}}
