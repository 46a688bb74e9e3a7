"""Deploy stage: a finished training job becomes a candidate, an evaluation job scores it, the gate
decides, and a passing model reaches the endpoint through a blue/green update that rolls back on
the endpoint's alarms. docs/deploy.md has the state machine; in brief:

- Candidates come from a final-stage job's Completed event or from the artefact's S3 object-created
  event ("checkpoint published"); both name the same model (the job's name, which carries the
  manifest hash), so the first creates `MODEL#<name>` and the second finds it.
- Every step is a conditional write on that record (evaluating -> passed | held-back | eval-failed
  | superseded -> deployed -> rolled-back), so duplicate events act once and Failed/Stopped jobs
  are recorded, never served.
- `ENDPOINT#<endpoint>` holds what is meant to serve and its order (the training end time): a
  claim succeeds only for a newer model, so an older model never replaces a newer one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from aws_lambda_powertools import Logger

from contracts import pipeline_table
from core import aws, telemetry, training_report
from core.deploy.gate import Evaluation, Scores, Thresholds, decide, parse_evaluation
from core.errors import BadMessage
from core.settings import DeploySettings
from core.training.instance_types import has_instance_store
from core.training.job_requests import encrypt_with_key

logger = Logger(child=True)
VARIANT = "AllTraffic"
EVAL_SUFFIX = "-eval"
EVALUATE_SOURCE, EVALUATE_REQUEST = "atelier.cli", "Evaluate Model"  # `atelier evaluate MODEL` puts this event
ROLE_TAG = "atelier:role"
CANDIDATE_TAG = "atelier:candidate"
FINAL_STAGE_TAG = "atelier:final-stage"
MANIFEST_TAG = "atelier:manifest"
TRAINING_JOB_TAG = "atelier:training-job"
ARTEFACT_SUFFIX = "/output/model.tar.gz"


class EndpointBusy(RuntimeError):
    """The endpoint is mid-update: an operator's rollback must wait until it is InService."""


@dataclass(frozen=True)
class JobState:
    name: str
    status: str
    model_data_url: str | None
    failure_reason: str | None
    final_stage: bool = True  # a run plan's earlier stages train on; only the last is served
    tags: tuple[tuple[str, str], ...] = ()
    ended_at: int = 0  # TrainingEndTime in epoch milliseconds: what "newer" means

    @property
    def tag_map(self) -> dict[str, str]:
        return dict(self.tags)

    @property
    def is_evaluation(self) -> bool:
        return self.tag_map.get(ROLE_TAG) == "evaluation" or self.name.endswith(EVAL_SUFFIX)


@dataclass(frozen=True)
class DeployResult:
    action: str  # recorded | evaluating | held-back | eval-failed | superseded | created | updated | duplicate | ...
    model: str | None = None
    reason: str = ""


# --- events -> job states -----------------------------------------------------------------------

def job_state_from_event(detail: dict[str, Any]) -> JobState:
    try:
        tags = _tags(detail.get("Tags"))
        return JobState(
            name=detail["TrainingJobName"],
            status=detail["TrainingJobStatus"],
            model_data_url=(detail.get("ModelArtifacts") or {}).get("S3ModelArtifacts"),
            failure_reason=detail.get("FailureReason"),
            final_stage=tags.get(FINAL_STAGE_TAG, "true") != "false",
            tags=tuple(sorted(tags.items())),
            ended_at=_epoch_ms(detail.get("TrainingEndTime") or detail.get("LastModifiedTime")),
        )
    except KeyError as exc:
        raise BadMessage(f"training job state change without {exc}") from exc


def job_from_artefact_key(key: str) -> str:
    """`training/<job>/output/model.tar.gz` -> the job's name."""
    if not key.startswith("training/") or not key.endswith(ARTEFACT_SUFFIX):
        raise BadMessage(f"{key} is not a training job's model artefact")
    return key.removeprefix("training/").removesuffix(ARTEFACT_SUFFIX)


def _tags(tags: object) -> dict[str, str]:
    """Event details carry tags as a map; DescribeTrainingJob-style lists are read too."""
    if isinstance(tags, dict):
        return {str(k): str(v) for k, v in tags.items()}
    if isinstance(tags, list):
        return {str(t.get("Key")): str(t.get("Value")) for t in tags if isinstance(t, dict)}
    return {}


def _epoch_ms(value: object) -> int:
    """Event times are epoch milliseconds; boto3 gives datetimes; ISO text is read too."""
    if isinstance(value, datetime):
        return int(value.timestamp() * 1000)
    if isinstance(value, int | float):
        return int(value)
    if isinstance(value, str) and value:
        return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1000)
    return 0


# --- requests (pure) ----------------------------------------------------------------------------

def model_name_for(job: JobState) -> str:
    """The training job's name: it carries the manifest hash, and each job yields one model."""
    return job.name


def model_request(job: JobState, settings: DeploySettings) -> dict[str, Any]:
    manifest = job.tag_map.get(MANIFEST_TAG, "")
    return {
        "ModelName": model_name_for(job),
        "ExecutionRoleArn": settings.role_arn,
        "PrimaryContainer": {
            "Image": settings.image_uri, "ModelDataUrl": job.model_data_url,
            # what every generated PNG carries (trainer/serve.py)
            "Environment": {"ATELIER_MODEL_ID": model_name_for(job), "ATELIER_MANIFEST_DIGEST": manifest,
                            "ATELIER_ATTRIBUTION_URI": attribution_uri(job, settings)},
        },
        "EnableNetworkIsolation": True,
        "Tags": [{"Key": TRAINING_JOB_TAG, "Value": job.name}, {"Key": MANIFEST_TAG, "Value": manifest}],
    }


def attribution_uri(job: JobState, settings: DeploySettings) -> str:
    """Where the start-training stage writes the model's attribution report (docs/provenance.md)."""
    return f"s3://{settings.models_bucket}/training/{job.name}/output/attribution.json"


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
    """The training image with task=evaluate on the held-out set (trainer/evaluate.py)."""
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
        "OutputDataConfig": {"S3OutputPath": f"s3://{settings.models_bucket}/evaluations/"},
        "ResourceConfig": {"InstanceType": settings.eval_instance_type, "InstanceCount": 1, "VolumeSizeInGB": 50},
        "StoppingCondition": {"MaxRuntimeInSeconds": settings.max_eval_runtime_s},
        "EnableNetworkIsolation": True,
        "EnableInterContainerTrafficEncryption": True,
        "Tags": [{"Key": ROLE_TAG, "Value": "evaluation"}, {"Key": CANDIDATE_TAG, "Value": candidate["model"]},
                 {"Key": "atelier:baseline", "Value": production["model"] if production else ""}],
    }
    encrypt_with_key(request, settings.kms_key)
    return request


def _channel(name: str, uri: str) -> dict[str, Any]:
    return {"ChannelName": name, "InputMode": "File",
            "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": uri,
                                            "S3DataDistributionType": "FullyReplicated"}}}


def thresholds(settings: DeploySettings) -> Thresholds:
    return Thresholds(settings.gate_max_loss, settings.gate_max_loss_ratio, settings.gate_min_clip_delta)


# --- entry points -------------------------------------------------------------------------------

def on_job_state(job: JobState, settings: DeploySettings) -> DeployResult:
    """A training job changed state: evaluation jobs feed the gate; final-stage Completed jobs
    become candidates; everything else is recorded and left alone."""
    if job.is_evaluation:
        return on_evaluation_finished(job, settings)
    _record_job_status(job, settings)
    if job.status != "Completed" or not job.final_stage:
        logger.info("training job state recorded", extra={"job": job.name, "status": job.status})
        return DeployResult("recorded", reason=f"{job.status}, final stage {job.final_stage}")
    if not job.model_data_url:
        raise BadMessage(f"Completed job {job.name} has no ModelArtifacts")
    return consider_candidate(job, settings)


def on_artefact_published(bucket: str, key: str, settings: DeploySettings) -> DeployResult:
    """The model artefact landed in S3: a candidate once its job is Completed (a Stopped job's
    artefact lands too, and must never be served)."""
    job = describe_job(job_from_artefact_key(key))
    if job is None:
        return DeployResult("recorded", reason=f"no training job for s3://{bucket}/{key}")
    if job.status != "Completed" or not job.final_stage or job.is_evaluation:
        return DeployResult("recorded", job.name, f"artefact of a {job.status} job (final stage {job.final_stage})")
    return consider_candidate(job, settings)


def describe_job(name: str) -> JobState | None:
    described = aws.describe_training_job(name)
    if described is None:
        return None
    return job_state_from_event({**described, "Tags": aws.sagemaker_tags(described["TrainingJobArn"])})


def consider_candidate(job: JobState, settings: DeploySettings) -> DeployResult:
    """Record the candidate once, then start its evaluation unless production is newer."""
    name = model_name_for(job)
    aws.put_item_if_absent(settings.table, {
        "pk": pipeline_table.model_pk(name), "kind": "model", "model": name, "status": "evaluating", "job": job.name,
        "manifest": job.tag_map.get(MANIFEST_TAG, ""), "model_data": job.model_data_url or "",
        "order": job.ended_at, "created_at": _now(), "endpoint": settings.endpoint_name,
        "job_tags": json.dumps(job.tag_map, sort_keys=True)})
    model = aws.get_item(settings.table, pipeline_table.model_pk(name)) or {}
    if model.get("status") != "evaluating" or model.get("eval_job"):
        return DeployResult("duplicate", name, f"already {model.get('status')}")
    return evaluate_unless_superseded(model, settings)


def evaluate_unless_superseded(model: dict[str, Any], settings: DeploySettings, attempt: int = 0) -> DeployResult:
    """Start the model's evaluation, unless production is newer or there is no held-out set."""
    name = model["model"]
    production = production_model(settings)
    if production and int(production["order"]) >= int(model["order"]):
        _settle(name, "superseded", f"older than production model {production['model']}", settings)
        return DeployResult("superseded", name)
    if not has_eval_shards(settings.eval_data_uri):
        _settle(name, "eval-failed", f"no held-out shards (*.tar) under {settings.eval_data_uri}: add them "
                f"with `atelier evalset add`, then `atelier evaluate {name}`", settings)
        telemetry.count(telemetry.MODELS_HELD_BACK)
        return DeployResult("eval-failed", name, "no evaluation set")
    return start_evaluation(model, production, settings, attempt)


def reevaluate(name: str, settings: DeploySettings) -> DeployResult:
    """`atelier evaluate MODEL`: an eval-failed model (no held-out set then, or a failed evaluation
    job) is evaluated again, under a new evaluation job name; any other state is left alone."""
    model = aws.get_item(settings.table, pipeline_table.model_pk(name))
    if model is None:
        raise BadMessage(f"no model {name!r} (`atelier models` lists them)")
    attempt = int(model.get("eval_attempt", 0)) + 1
    if not aws.update_item(settings.table, pipeline_table.model_pk(name),
                           "SET #s = :evaluating, eval_attempt = :a, reason = :r REMOVE eval_job",
                           {":evaluating": "evaluating", ":a": attempt, ":r": "evaluated again on request",
                            ":failed": "eval-failed"}, condition="#s = :failed", names={"#s": "status"}):
        return DeployResult("duplicate", name, f"{model.get('status')}, not eval-failed: left as it is")
    logger.info("evaluation requested again", extra={"model": name, "attempt": attempt})
    model = {k: v for k, v in model.items() if k != "eval_job"}
    return evaluate_unless_superseded({**model, "status": "evaluating", "eval_attempt": attempt}, settings, attempt)


def has_eval_shards(uri: str) -> bool:
    """Whether the held-out set has a shard: checked before an evaluation job (minutes of an
    instance) is started only to fail on an empty channel."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return any(item["Key"].endswith(".tar") for item in aws.list_objects(bucket, prefix))


def start_evaluation(model: dict[str, Any], production: dict[str, Any] | None, settings: DeploySettings,
                     attempt: int = 0) -> DeployResult:
    name = evaluation_job_name(model["model"], attempt)
    request = evaluation_job_request(name, model, production, settings)
    aws.create_training_job(request)  # False: a redelivered event found it started already
    aws.update_item(settings.table, pipeline_table.model_pk(model["model"]), "SET eval_job = :j, baseline = :b",
                    {":j": name, ":b": production["model"] if production else ""})
    logger.info("evaluation started", extra={"model": model["model"], "eval_job": name,
                                             "baseline": production["model"] if production else None})
    return DeployResult("evaluating", model["model"])


def on_evaluation_finished(job: JobState, settings: DeploySettings) -> DeployResult:
    name = job.tag_map.get(CANDIDATE_TAG) or job.name.removesuffix(EVAL_SUFFIX)
    model = aws.get_item(settings.table, pipeline_table.model_pk(name))
    if model is None:
        return DeployResult("recorded", reason=f"evaluation {job.name} of an unknown model")
    if job.status in {"InProgress", "Stopping"}:
        return DeployResult("recorded", name, job.status)
    if model.get("status") != "evaluating" or model.get("eval_job") != job.name:
        return DeployResult("duplicate", name, f"already {model.get('status')}")
    if job.status != "Completed" or not job.model_data_url:
        _settle(name, "eval-failed", f"evaluation {job.name} {job.status}: {job.failure_reason or ''}".strip(), settings)
        telemetry.count(telemetry.MODELS_HELD_BACK)
        return DeployResult("eval-failed", name)
    evaluation = parse_evaluation(aws.read_tar_member(job.model_data_url, "evaluation.json"))
    return gate(model, evaluation, settings)


def gate(model: dict[str, Any], evaluation: Evaluation, settings: DeploySettings) -> DeployResult:
    """Compare with production on the same evaluation set; promote, hold back, or re-evaluate."""
    name = model["model"]
    production = production_model(settings)
    baseline = _production_scores(production, model, evaluation)
    if production and baseline is None:  # production changed, or was scored on another set: score again
        attempt = int(model.get("eval_attempt", 0)) + 1
        aws.update_item(settings.table, pipeline_table.model_pk(name), "SET eval_attempt = :a", {":a": attempt})
        return start_evaluation({**model, "eval_attempt": attempt}, production, settings, attempt)
    decision = decide(evaluation.candidate, baseline, thresholds(settings))
    status = "passed" if decision.passed else "held-back"
    gate_record = {"decision": status, "reason": decision.reason, "scores": evaluation.candidate.to_item(),
                   "production": baseline.to_item() if baseline else None,
                   "production_model": production["model"] if production else "",
                   "thresholds": {"max_loss": settings.gate_max_loss, "max_loss_ratio": settings.gate_max_loss_ratio,
                                  "min_clip_delta": settings.gate_min_clip_delta}}
    if not _settle(name, status, decision.reason, settings, gate=json.dumps(gate_record),
                   scores=evaluation.candidate.to_item()):
        return DeployResult("duplicate", name)
    logger.info("evaluation gate", extra={"model": name, "decision": status, "reason": decision.reason})
    document = _publish_decision(model, gate_record)
    telemetry.count(telemetry.MODELS_EVALUATED)
    if not decision.passed:
        telemetry.count(telemetry.MODELS_HELD_BACK)
        result = DeployResult("held-back", name, decision.reason)
    else:
        result = promote(name, settings)
    try:  # last, and never fatal: the decision is recorded, and a retried event would find it a duplicate
        _publish_report(model, document)
    except Exception:  # noqa: BLE001 - a report is for people; `atelier report --job` renders it again
        logger.exception("training report not written", extra={"model": name})
    return result


def _publish_decision(model: dict[str, Any], gate_record: dict[str, Any]) -> dict[str, Any]:
    """`evaluation.json` beside the model artefact: the training report shows it (atelier report --job)."""
    bucket, _, key = str(model["model_data"]).removeprefix("s3://").partition("/")
    document = {"gate": gate_record, "model": model["model"], "evaluation_job": model.get("eval_job", "")}
    aws.write_object(bucket, f"{key.rsplit('/', 1)[0]}/evaluation.json",
                     json.dumps(document, indent=1).encode(), "application/json")
    return document


def _publish_report(model: dict[str, Any], evaluation: dict[str, Any]) -> None:
    """The complete training report, `report.html` beside the model artefact: the run (report_data),
    the gate's decision and lineage.json."""
    bucket, _, key = str(model["model_data"]).removeprefix("s3://").partition("/")
    folder = key.rsplit("/", 1)[0]
    run, grids = report_data(bucket, folder)
    page = training_report.page(model["job"], run, grids, evaluation, aws.read_json_if_exists(bucket, f"{folder}/lineage.json"))
    aws.write_object(bucket, f"{folder}/{training_report.REPORT}", page.encode(), "text/html; charset=utf-8")


def report_data(bucket: str, folder: str) -> tuple[dict[str, Any] | None, list[tuple[str, bytes]]]:
    """The run's figures and validation grids a training job left in `folder`, from its output.tar.gz
    (the trainer's report.html carries the figures; a page from an older trainer has none: None)."""
    if aws.head_object(bucket, f"{folder}/output.tar.gz") is None:
        return None, []
    _, body = aws.open_object(bucket, f"{folder}/output.tar.gz")
    with body:
        return training_report.read_output(body)


def _production_scores(production: dict[str, Any] | None, model: dict[str, Any],
                       evaluation: Evaluation) -> Scores | None:
    """Production's scores from this very evaluation when it scored production, else from
    production's own record when that was on the same evaluation set."""
    if production is None:
        return None
    if evaluation.baseline and model.get("baseline") == production["model"]:
        return evaluation.baseline
    stored = production.get("scores")
    if stored and Scores.from_item(stored).eval_set == evaluation.candidate.eval_set:
        return Scores.from_item(stored)
    return None


# --- promotion, rollback ------------------------------------------------------------------------

def promote(name: str, settings: DeploySettings) -> DeployResult:
    """Create the model and config, claim the endpoint for this newer model, update it blue/green."""
    model = aws.get_item(settings.table, pipeline_table.model_pk(name)) or {}
    job = JobState(name=model["job"], status="Completed", model_data_url=model["model_data"], failure_reason=None,
                   tags=tuple(sorted(json.loads(model.get("job_tags") or "{}").items())), ended_at=int(model["order"]))
    if not aws.sagemaker_exists("model", name):
        aws.sagemaker_call("create_model", model_request(job, settings))
    if not aws.sagemaker_exists("endpoint_config", name):
        aws.sagemaker_call("create_endpoint_config", endpoint_config_request(job, settings))
    endpoint = aws.describe_endpoint(settings.endpoint_name)
    if endpoint is not None and endpoint["EndpointStatus"] not in {"InService", "Failed"}:
        # stays `passed`: the endpoint's next InService event promotes the newest passed model
        return DeployResult("waiting", name, f"endpoint {settings.endpoint_name} is {endpoint['EndpointStatus']}")
    previous = production_model(settings)
    if not _claim_endpoint(name, int(model["order"]), previous, settings):
        _settle(name, "superseded", "a newer model took the endpoint first", settings, expected="passed")
        return DeployResult("superseded", name)
    request = {"EndpointName": settings.endpoint_name, "EndpointConfigName": name,
               "DeploymentConfig": deployment_config(settings)}
    if endpoint is None:
        aws.sagemaker_call("create_endpoint", request)
        action = "created"
    elif endpoint.get("EndpointConfigName") == name:
        action = "unchanged"
    else:
        aws.sagemaker_call("update_endpoint", request)
        action = "updated"
    _settle(name, "deployed", f"endpoint {settings.endpoint_name} {action}", settings, expected="passed",
            deployed_at=_now())
    logger.info("endpoint deployment", extra={"model": name, "endpoint": settings.endpoint_name, "action": action})
    if action != "unchanged":
        telemetry.count(telemetry.DEPLOYMENTS)
    return DeployResult(action, name)


def _claim_endpoint(name: str, order: int, previous: dict[str, Any] | None, settings: DeploySettings) -> bool:
    """The endpoint record moves to this model only if it is newer than what serves (or it already did)."""
    history = list((previous or {}).get("history", []))
    if not history or history[-1] != name:
        history.append(name)
    return aws.update_item(
        settings.table, pipeline_table.endpoint_pk(settings.endpoint_name),
        "SET model = :m, #o = :o, history = :h, updated_at = :t, deployment_config = :d",
        {":m": name, ":o": order, ":h": history[-20:], ":t": _now(), ":d": json.dumps(deployment_config(settings))},
        condition="attribute_not_exists(model) OR #o < :o OR model = :m", names={"#o": "order"})


def production_model(settings: DeploySettings) -> dict[str, Any] | None:
    return serving_record(settings.table, settings.endpoint_name)


def serving_record(table: str, endpoint: str) -> dict[str, Any] | None:
    """The model the endpoint record says serves, with its order, scores and rollout history."""
    record = aws.get_item(table, pipeline_table.endpoint_pk(endpoint))
    if not record or not record.get("model"):
        return None
    model = aws.get_item(table, pipeline_table.model_pk(record["model"])) or {}
    return {**model, "model": record["model"], "order": int(record["order"]), "history": record.get("history", []),
            "deployment_config": record.get("deployment_config", "{}")}


def rollback(table: str, endpoint_name: str, to: str | None = None,
             reason: str = "rolled back by an operator") -> DeployResult:
    """Serve the previous deployed model again (or `to`), with the rollout settings it went out
    with; the current one is marked rolled-back so no duplicate event brings it back."""
    current = serving_record(table, endpoint_name)
    if current is None:
        raise BadMessage(f"endpoint {endpoint_name} has no deployed model to roll back")
    history = list(current["history"])
    earlier = [m for m in history[:-1] if m != current["model"]]
    target = to or (earlier[-1] if earlier else None)
    if target is None or target not in history or target == current["model"]:
        raise BadMessage(f"no earlier model to roll back to (history: {', '.join(history)})")
    endpoint = aws.describe_endpoint(endpoint_name)
    if endpoint is None:
        raise BadMessage(f"endpoint {endpoint_name} does not exist")
    if endpoint["EndpointStatus"] not in {"InService", "Failed"}:
        raise EndpointBusy(f"endpoint {endpoint_name} is {endpoint['EndpointStatus']}; try again when InService")
    request: dict[str, Any] = {"EndpointName": endpoint_name, "EndpointConfigName": target}
    if json.loads(current["deployment_config"]):
        request["DeploymentConfig"] = json.loads(current["deployment_config"])
    aws.sagemaker_call("update_endpoint", request)
    _mark_rolled_back(table, endpoint_name, current["model"], target, history, reason)
    return DeployResult("rolled-back", target, f"{current['model']} -> {target}")


def on_endpoint_state(endpoint_name: str, settings: DeploySettings) -> DeployResult:
    """An endpoint changed state: once InService, reconcile with SageMaker's truth (an automatic
    rollback leaves the previous config serving), make sure autoscaling is registered, and
    promote a model that passed the gate while the endpoint was busy."""
    if endpoint_name != settings.endpoint_name:
        return DeployResult("recorded", reason=f"endpoint {endpoint_name} is not ours")
    endpoint = aws.describe_endpoint(endpoint_name)
    if endpoint is None or endpoint["EndpointStatus"] != "InService":
        return DeployResult("recorded", reason=f"endpoint {(endpoint or {}).get('EndpointStatus', 'gone')}")
    ensure_autoscaling(settings)
    current = production_model(settings)
    serving = endpoint.get("EndpointConfigName")
    if current is not None and serving != current["model"] and serving in current["history"]:
        _mark_rolled_back(settings.table, endpoint_name, current["model"], serving, current["history"],
                          "rolled back automatically: an endpoint alarm fired during the rollout")
        logger.warning("automatic rollback", extra={"model": current["model"], "serving": serving})
        return DeployResult("rolled-back", serving, f"{current['model']} rolled back by SageMaker")
    waiting = newest_passed(settings)
    if waiting is not None:
        return promote(waiting, settings)
    return DeployResult("in-service", serving)


def newest_passed(settings: DeploySettings) -> str | None:
    """A model that passed the gate while the endpoint was busy, newest first."""
    passed = [m for m in aws.scan_prefix(settings.table, "MODEL#")
              if m.get("status") == "passed" and m.get("endpoint") == settings.endpoint_name]
    return max(passed, key=lambda m: int(m["order"]))["model"] if passed else None


def _mark_rolled_back(table: str, endpoint: str, current: str, target: str, history: list[str], reason: str) -> None:
    telemetry.count(telemetry.ROLLBACKS)
    aws.update_item(table, pipeline_table.model_pk(current), "SET #s = :s, reason = :r",
                    {":s": "rolled-back", ":r": reason}, names={"#s": "status"})
    target_model = aws.get_item(table, pipeline_table.model_pk(target)) or {}
    # the history ends at the model serving again: what it replaced is not "previous" any more
    kept = history[:len(history) - history[::-1].index(target)] if target in history else [*history, target]
    aws.update_item(table, pipeline_table.endpoint_pk(endpoint), "SET model = :m, #o = :o, history = :h, updated_at = :t",
                    {":m": target, ":o": int(target_model.get("order", 0)), ":h": kept, ":t": _now()},
                    names={"#o": "order"})


def ensure_autoscaling(settings: DeploySettings) -> None:
    """Target tracking on invocations per instance; registering again is harmless."""
    resource = f"endpoint/{settings.endpoint_name}/variant/{VARIANT}"
    aws.register_scalable_target(resource, settings.min_instances, settings.max_instances)
    aws.put_target_tracking_policy(resource, f"{settings.endpoint_name}-invocations",
                                   float(settings.invocations_per_instance))


# --- records ------------------------------------------------------------------------------------

def _record_job_status(job: JobState, settings: DeploySettings) -> None:
    """Only jobs the pipeline started have a record: never create one for another job."""
    aws.update_item(settings.table, pipeline_table.job_pk(job.name), "SET #s = :s, failure_reason = :r, model_data = :m",
                    {":s": job.status, ":r": job.failure_reason or "", ":m": job.model_data_url or ""},
                    condition="attribute_exists(pk)", names={"#s": "status"})


def _settle(name: str, status: str, reason: str, settings: DeploySettings, expected: str = "evaluating",
            **extra: Any) -> bool:
    """One transition of a model's record; False when another invocation made it first."""
    sets = ", ".join(f"{k} = :{k}" for k in extra)
    return aws.update_item(settings.table, pipeline_table.model_pk(name),
                           "SET #s = :s, reason = :r" + (f", {sets}" if sets else ""),
                           {":s": status, ":r": reason, ":expected": expected, **{f":{k}": v for k, v in extra.items()}},
                           condition="#s = :expected", names={"#s": "status"})


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
