"""Create the resources of an expanded template through the service APIs (moto, or any AWS).

Lambda functions are not created in the service: they are handed to the local runtime as
`FunctionSpec`s, with `EventSource`s for their SQS event source mappings and EventBridge rules.
EventBridge cannot target a local function, so each Lambda target of a rule becomes an SQS
queue that the runtime polls; its redrive policy sends an event that fails every retry to the
function's dead-letter queue, as Lambda's asynchronous invocation does.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from atelier.local.template import LOCAL_CODE_BUCKET, Expanded, Resolver, TemplateError, creation_order

log = logging.getLogger("atelier.local")
ASYNC_RETRIES_DEFAULT = 2  # Lambda retries a failed asynchronous invocation twice by default
LAMBDA_ENVIRONMENT_BYTES = 4096  # Lambda quotas: "Environment variables, 4 KB", all of a function's together


@dataclass
class FunctionSpec:
    logical_id: str
    name: str
    handler: str
    code_dir: Path
    environment: dict[str, str]
    timeout_s: int
    memory_mb: int
    dead_letter_arn: str | None = None
    async_retries: int = ASYNC_RETRIES_DEFAULT
    reserved_concurrency: int | None = None  # ReservedConcurrentExecutions: at most this many at once


@dataclass
class EventSource:
    """A queue the runtime polls for one function: an SQS mapping, or a rule's delivery queue."""

    function: str  # logical id
    kind: str  # "sqs" | "eventbridge"
    queue_url: str
    queue_arn: str
    batch_size: int = 1
    window_s: int = 0
    report_batch_item_failures: bool = False
    schedule_s: int = 0  # a scheduled rule: the runtime puts an event on the queue this often
    rule_arn: str = ""
    max_concurrency: int | None = None  # an SQS mapping's ScalingConfig.MaximumConcurrency (None: no cap)


@dataclass
class Provisioned:
    stack: str
    region: str
    account: str
    physical: dict[str, str] = field(default_factory=dict)
    functions: dict[str, FunctionSpec] = field(default_factory=dict)
    sources: list[EventSource] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "stack": self.stack, "region": self.region, "account": self.account,
            "physical": self.physical, "outputs": self.outputs, "skipped": self.skipped,
            "functions": {k: {**vars(f), "code_dir": str(f.code_dir)} for k, f in self.functions.items()},
            "sources": [vars(s) for s in self.sources],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Provisioned":
        functions = {k: FunctionSpec(**{**f, "code_dir": Path(f["code_dir"])}) for k, f in data["functions"].items()}
        return cls(data["stack"], data["region"], data["account"], data["physical"], functions,
                   [EventSource(**s) for s in data["sources"]], data["outputs"], data["skipped"])


class Provisioner:
    def __init__(self, expanded: Expanded, stack: str, region: str, account: str,
                 client: Callable[[str], Any]) -> None:
        self.expanded = expanded
        # one client per service: creating a botocore client costs more than most of the calls made with it
        self.client = functools.cache(client)
        self.result = Provisioned(stack, region, account)
        self.attributes: dict[str, dict[str, Any]] = {}
        self.resolver = Resolver(expanded.parameters, expanded.conditions, self._ref, self._get_att,
                                 expanded.list_parameters, expanded.mappings)

    # --- references -----------------------------------------------------------------------------
    def _ref(self, logical: str) -> str:
        if logical not in self.result.physical:
            raise TemplateError(f"Ref to {logical}, which is not created (yet)")
        return self.result.physical[logical]

    def _get_att(self, logical: str, attribute: str) -> Any:
        try:
            return self.attributes[logical][attribute]
        except KeyError:
            raise TemplateError(f"Fn::GetAtt {logical}.{attribute} is not available locally") from None

    def _name(self, logical: str, props: dict[str, Any], key: str) -> str:
        return str(props.get(key) or f"{self.result.stack}-{logical}")

    def _arn(self, service: str, resource: str, regional: bool = True) -> str:
        region = self.result.region if regional else ""
        account = self.result.account if service != "s3" else ""
        return f"arn:aws:{service}:{region}:{account}:{resource}"

    # --- the walk -------------------------------------------------------------------------------
    def provision(self) -> Provisioned:
        creators = self._creators()
        for logical in creation_order(self.expanded.resources):
            resource = self.expanded.resources[logical]
            if "Condition" in resource and not self.resolver.condition(resource["Condition"]):
                continue
            create = creators.get(resource["Type"])
            if create is None:
                self.result.skipped[logical] = resource["Type"]
                self.result.physical[logical] = f"{self.result.stack}-{logical}"
                continue
            create(logical, self.resolver.resolve(resource.get("Properties", {})))
        self.result.outputs = {k: str(self.resolver.resolve(v["Value"])) for k, v in self.expanded.outputs.items()
                               if "Condition" not in v or self.resolver.condition(v["Condition"])}
        return self.result

    def _creators(self) -> dict[str, Callable[[str, dict[str, Any]], None]]:
        return {
            "AWS::S3::Bucket": self._bucket, "AWS::S3::BucketPolicy": self._bucket_policy,
            "AWS::SQS::Queue": self._queue, "AWS::SQS::QueuePolicy": self._queue_policy,
            "AWS::DynamoDB::Table": self._table, "AWS::Logs::LogGroup": self._log_group,
            "AWS::IAM::Role": self._role, "AWS::IAM::ManagedPolicy": self._managed_policy,
            "AWS::Lambda::Function": self._function,
            "AWS::Lambda::EventInvokeConfig": self._event_invoke_config,
            "AWS::Lambda::EventSourceMapping": self._event_source_mapping,
            "AWS::Lambda::Permission": self._permission, "AWS::Events::Rule": self._rule,
            "AWS::CloudWatch::Alarm": self._alarm,
        }

    # --- S3 -------------------------------------------------------------------------------------
    def _bucket(self, logical: str, props: dict[str, Any]) -> None:
        name = self._name(logical, props, "BucketName").lower()
        s3 = self.client("s3")
        if self.result.region == "us-east-1":
            s3.create_bucket(Bucket=name)
        else:
            s3.create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": self.result.region})
        if "BucketEncryption" in props:
            s3.put_bucket_encryption(Bucket=name, ServerSideEncryptionConfiguration=_encryption(props["BucketEncryption"]))
        if "PublicAccessBlockConfiguration" in props:
            s3.put_public_access_block(Bucket=name, PublicAccessBlockConfiguration=props["PublicAccessBlockConfiguration"])
        if "VersioningConfiguration" in props:
            s3.put_bucket_versioning(Bucket=name, VersioningConfiguration=props["VersioningConfiguration"])
        if "LifecycleConfiguration" in props:
            s3.put_bucket_lifecycle_configuration(Bucket=name, LifecycleConfiguration=_lifecycle(props["LifecycleConfiguration"]))
        notifications = props.get("NotificationConfiguration", {})
        if notifications:
            s3.put_bucket_notification_configuration(Bucket=name, NotificationConfiguration=_notifications(notifications))
        self.result.physical[logical] = name
        self.attributes[logical] = {"Arn": f"arn:aws:s3:::{name}", "DomainName": f"{name}.s3.amazonaws.com"}

    def _bucket_policy(self, logical: str, props: dict[str, Any]) -> None:
        """Applied without statements on aws:SecureTransport: moto cannot evaluate that key (it
        treats every conditional Deny as matching) and the local endpoint is plain HTTP."""
        document = dict(props["PolicyDocument"])
        statements = document["Statement"] if isinstance(document["Statement"], list) else [document["Statement"]]
        kept = [s for s in statements if "aws:SecureTransport" not in json.dumps(s.get("Condition", {}))]
        if len(kept) < len(statements):
            self.result.skipped[logical] = "statements on aws:SecureTransport (TLS-only) are not applied locally"
        if kept:
            self.client("s3").put_bucket_policy(Bucket=props["Bucket"], Policy=json.dumps({**document, "Statement": kept}))
        self.result.physical[logical] = props["Bucket"]

    # --- SQS ------------------------------------------------------------------------------------
    def _queue(self, logical: str, props: dict[str, Any]) -> None:
        name = self._name(logical, props, "QueueName")
        attributes = {k: json.dumps(v) if isinstance(v, dict) else str(v).lower() if isinstance(v, bool) else str(v)
                      for k, v in props.items() if k not in {"QueueName", "Tags"}}
        url = self.client("sqs").create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
        self.result.physical[logical] = url
        self.attributes[logical] = {"Arn": self._arn("sqs", name), "QueueName": name, "QueueUrl": url}

    def _queue_policy(self, logical: str, props: dict[str, Any]) -> None:
        for url in props["Queues"]:
            self.client("sqs").set_queue_attributes(QueueUrl=url, Attributes={"Policy": json.dumps(props["PolicyDocument"])})
        self.result.physical[logical] = f"{self.result.stack}-{logical}"

    def _queue_url(self, arn: str) -> str:
        for logical, attrs in self.attributes.items():
            if attrs.get("Arn") == arn and "QueueUrl" in attrs:
                return attrs["QueueUrl"]
        raise TemplateError(f"no queue with ARN {arn} in the template")

    # --- DynamoDB, Logs, IAM ----------------------------------------------------------------------
    def _table(self, logical: str, props: dict[str, Any]) -> None:
        name = self._name(logical, props, "TableName")
        request = {k: v for k, v in props.items() if k in {
            "AttributeDefinitions", "KeySchema", "GlobalSecondaryIndexes", "LocalSecondaryIndexes", "BillingMode",
            "ProvisionedThroughput", "StreamSpecification"}}
        if "SSESpecification" in props:
            request["SSESpecification"] = {"Enabled": bool(props["SSESpecification"].get("SSEEnabled"))}
        self.client("dynamodb").create_table(TableName=name, **request)
        self.result.physical[logical] = name
        self.attributes[logical] = {"Arn": self._arn("dynamodb", f"table/{name}")}

    def _log_group(self, logical: str, props: dict[str, Any]) -> None:
        name = self._name(logical, props, "LogGroupName")
        logs = self.client("logs")
        logs.create_log_group(logGroupName=name)
        if "RetentionInDays" in props:
            logs.put_retention_policy(logGroupName=name, retentionInDays=int(props["RetentionInDays"]))
        self.result.physical[logical] = name
        self.attributes[logical] = {"Arn": self._arn("logs", f"log-group:{name}:*")}

    def _alarm(self, logical: str, props: dict[str, Any]) -> None:
        """Stored in moto, which never evaluates it (the local stack's AlarmEvaluator does), without
        actions: nothing local would receive them. Ref is the alarm name, as in CloudFormation."""
        name = self._name(logical, props, "AlarmName")
        request = {k: v for k, v in props.items() if k in {
            "AlarmDescription", "Namespace", "MetricName", "Dimensions", "Statistic", "ExtendedStatistic", "Unit",
            "ComparisonOperator", "TreatMissingData", "EvaluateLowSampleCountPercentile", "Metrics"}}
        request.update({k: int(props[k]) for k in ("Period", "EvaluationPeriods", "DatapointsToAlarm") if k in props})
        if "Threshold" in props:
            request["Threshold"] = float(props["Threshold"])
        self.client("cloudwatch").put_metric_alarm(AlarmName=name, **request)
        self.result.physical[logical] = name
        self.attributes[logical] = {"Arn": self._arn("cloudwatch", f"alarm:{name}")}

    def _role(self, logical: str, props: dict[str, Any]) -> None:
        name = self._name(logical, props, "RoleName")[:64]
        iam = self.client("iam")
        iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(props["AssumeRolePolicyDocument"]))
        for policy in props.get("Policies", []):
            # SAM's policy templates omit Version (IAM then reads 2008-10-17, which differs only
            # in policy variables, unused here); moto insists on one.
            document = {"Version": "2012-10-17", **policy["PolicyDocument"]}
            iam.put_role_policy(RoleName=name, PolicyName=policy["PolicyName"], PolicyDocument=json.dumps(document))
        for arn in props.get("ManagedPolicyArns", []):
            try:
                iam.attach_role_policy(RoleName=name, PolicyArn=arn)
            except iam.exceptions.NoSuchEntityException:
                log.info("managed policy %s is not known locally; role %s goes without it", arn, name)
        self.result.physical[logical] = name
        self.attributes[logical] = {"Arn": f"arn:aws:iam::{self.result.account}:role/{name}"}

    def _managed_policy(self, logical: str, props: dict[str, Any]) -> None:
        """Ref is the policy's ARN, as in CloudFormation (roles made later name it, e.g. as a boundary)."""
        name = self._name(logical, props, "ManagedPolicyName")[:128]
        request = {"PolicyName": name, "PolicyDocument": json.dumps(props["PolicyDocument"]),
                   **{k: props[k] for k in ("Path", "Description") if k in props}}
        arn = self.client("iam").create_policy(**request)["Policy"]["Arn"]
        self.result.physical[logical] = arn
        self.attributes[logical] = {"PolicyArn": arn}

    # --- Lambda: handed to the local runtime ----------------------------------------------------
    def _function(self, logical: str, props: dict[str, Any]) -> None:
        name = self._name(logical, props, "FunctionName")
        code = props.get("Code", {})
        if code.get("S3Bucket") != LOCAL_CODE_BUCKET:
            raise TemplateError(f"{logical}: only local CodeUri folders can run locally")
        self.result.functions[logical] = FunctionSpec(
            logical_id=logical, name=name, handler=props["Handler"],
            code_dir=self.expanded.code_dirs[code["S3Key"]],
            environment=lambda_environment(logical, props.get("Environment", {}).get("Variables", {})),
            timeout_s=int(props.get("Timeout", 3)), memory_mb=int(props.get("MemorySize", 128)),
            dead_letter_arn=props.get("DeadLetterConfig", {}).get("TargetArn"),
            reserved_concurrency=int(props["ReservedConcurrentExecutions"]) if "ReservedConcurrentExecutions" in props
            else None,
        )
        self.result.physical[logical] = name
        self.attributes[logical] = {"Arn": self._arn("lambda", f"function:{name}")}

    def _function_by_ref(self, ref: str) -> FunctionSpec:
        for spec in self.result.functions.values():
            if ref in {spec.name, self.attributes[spec.logical_id]["Arn"]}:
                return spec
        raise TemplateError(f"no function {ref} in the template")

    def _event_invoke_config(self, logical: str, props: dict[str, Any]) -> None:
        spec = self._function_by_ref(props["FunctionName"])
        spec.async_retries = int(props.get("MaximumRetryAttempts", ASYNC_RETRIES_DEFAULT))
        self.result.physical[logical] = f"{spec.name}-invoke-config"

    def _event_source_mapping(self, logical: str, props: dict[str, Any]) -> None:
        spec = self._function_by_ref(props["FunctionName"])
        arn = props["EventSourceArn"]
        if ":sqs:" not in arn:
            raise TemplateError(f"{logical}: only SQS event sources run locally")
        self.result.sources.append(EventSource(
            function=spec.logical_id, kind="sqs", queue_url=self._queue_url(arn), queue_arn=arn,
            batch_size=int(props.get("BatchSize", 10)), window_s=int(props.get("MaximumBatchingWindowInSeconds", 0)),
            report_batch_item_failures="ReportBatchItemFailures" in props.get("FunctionResponseTypes", []),
            max_concurrency=int(props["ScalingConfig"]["MaximumConcurrency"])
            if "MaximumConcurrency" in props.get("ScalingConfig", {}) else None,
        ))
        self.result.physical[logical] = f"{self.result.stack}-{logical}"

    def _permission(self, logical: str, props: dict[str, Any]) -> None:
        self.result.physical[logical] = f"{self.result.stack}-{logical}"  # invocation is in-process

    # --- EventBridge ----------------------------------------------------------------------------
    def _rule(self, logical: str, props: dict[str, Any]) -> None:
        name = self._name(logical, props, "Name")[:64]
        bus = props.get("EventBusName", "default")
        events = self.client("events")
        rule: dict[str, Any] = {"Name": name, "EventBusName": bus, "State": props.get("State", "ENABLED")}
        if "EventPattern" in props:
            rule["EventPattern"] = json.dumps(props["EventPattern"])
        if "ScheduleExpression" in props:
            rule["ScheduleExpression"] = props["ScheduleExpression"]
        events.put_rule(**rule)
        schedule_s = _rate_seconds(props["ScheduleExpression"]) if "ScheduleExpression" in props else 0
        targets = [self._target(name, t, schedule_s) for t in props.get("Targets", [])]
        if targets:
            events.put_targets(Rule=name, EventBusName=bus, Targets=targets)
        self.result.physical[logical] = name
        self.attributes[logical] = {"Arn": self._arn("events", f"rule/{name}")}

    def _target(self, rule: str, target: dict[str, Any], schedule_s: int) -> dict[str, Any]:
        if ":lambda:" not in target["Arn"]:
            return {k: v for k, v in target.items() if k in {"Id", "Arn", "Input", "InputPath", "DeadLetterConfig"}}
        spec = self._function_by_ref(target["Arn"])
        attributes = {"VisibilityTimeout": str(spec.timeout_s)}
        if spec.dead_letter_arn:
            attributes["RedrivePolicy"] = json.dumps(
                {"deadLetterTargetArn": spec.dead_letter_arn, "maxReceiveCount": spec.async_retries + 1})
        queue = f"{rule}-{target['Id']}"[:80]
        url = self.client("sqs").create_queue(QueueName=queue, Attributes=attributes)["QueueUrl"]
        arn = self._arn("sqs", queue)
        self.result.sources.append(EventSource(function=spec.logical_id, kind="eventbridge", queue_url=url, queue_arn=arn,
                                               schedule_s=schedule_s, rule_arn=self._arn("events", f"rule/{rule}")))
        return {"Id": target["Id"], "Arn": arn}


def lambda_environment(logical: str, variables: dict[str, Any]) -> dict[str, str]:
    """A function's variables as strings, refused as Lambda refuses a set over its 4 KB quota (not adjustable),
    which it measures as the variables' compact JSON: a deploy that AWS would fail fails here too."""
    environment = {k: str(v) for k, v in variables.items()}
    measured = len(json.dumps(environment, separators=(",", ":")).encode())
    if measured > LAMBDA_ENVIRONMENT_BYTES:
        raise TemplateError(f"{logical}: Lambda was unable to configure your environment variables because the "
                            f"environment variables you have provided exceeded the 4KB limit ({measured} bytes)")
    return environment


def _rate_seconds(expression: str) -> int:
    """`rate(5 minutes)` -> 300. moto fires no schedules, so the runtime does; cron is not modelled."""
    match = re.fullmatch(r"rate\((\d+) (minute|minutes|hour|hours|day|days)\)", expression.strip())
    if not match:
        raise TemplateError(f"only rate(...) schedules run locally, not {expression!r}")
    unit = {"minute": 60, "hour": 3600, "day": 86400}[match.group(2).rstrip("s")]
    return int(match.group(1)) * unit


def _lifecycle(config: dict[str, Any]) -> dict[str, Any]:
    """CloudFormation's LifecycleConfiguration shape -> the S3 API's (the rule kinds used here)."""
    rules = []
    for rule in config["Rules"]:
        out: dict[str, Any] = {"ID": rule.get("Id", ""), "Status": rule["Status"],
                               "Filter": {"Prefix": rule.get("Prefix", "")}}
        if "ExpirationInDays" in rule:
            out["Expiration"] = {"Days": int(rule["ExpirationInDays"])}
        if "AbortIncompleteMultipartUpload" in rule:
            out["AbortIncompleteMultipartUpload"] = {
                "DaysAfterInitiation": int(rule["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"])}
        rules.append(out)
    return {"Rules": rules}


def _encryption(config: dict[str, Any]) -> dict[str, Any]:
    """CloudFormation's BucketEncryption shape -> the S3 API's."""
    rules = [{"ApplyServerSideEncryptionByDefault": r["ServerSideEncryptionByDefault"],
              **({"BucketKeyEnabled": r["BucketKeyEnabled"]} if "BucketKeyEnabled" in r else {})}
             for r in config["ServerSideEncryptionConfiguration"]]
    return {"Rules": rules}


def _notifications(config: dict[str, Any]) -> dict[str, Any]:
    """CloudFormation's NotificationConfiguration shape -> the S3 API's."""
    def queue(q: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"QueueArn": q["Queue"], "Events": [q["Event"]]}
        rules = q.get("Filter", {}).get("S3Key", {}).get("Rules")
        if rules:
            out["Filter"] = {"Key": {"FilterRules": rules}}
        return out

    result: dict[str, Any] = {}
    if config.get("QueueConfigurations"):
        result["QueueConfigurations"] = [queue(q) for q in config["QueueConfigurations"]]
    if config.get("EventBridgeConfiguration"):
        result["EventBridgeConfiguration"] = {}
    if config.get("TopicConfigurations") or config.get("LambdaConfigurations"):
        raise TemplateError("only queue and EventBridge bucket notifications run locally")
    return result
