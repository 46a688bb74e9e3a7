"""The wire protocols of the local SageMaker: SageMaker's JSON 1.1 and the Runtime's REST invocations.

One WSGI app answers both, as botocore speaks them: POST / with an X-Amz-Target header for the
SageMaker API, POST /endpoints/<name>/invocations for InvokeEndpoint. Errors come back in each
protocol's own shape, so botocore raises the ClientError AWS would.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

from werkzeug.wrappers import Request, Response

from atelier.local.sagemaker.documents import convert_times, epoch_seconds
from atelier.local.sagemaker.endpoints import Hosting
from atelier.local.sagemaker.shape_checks import check_shape
from atelier.local.sagemaker.tags import ResourceTags
from atelier.local.sagemaker.training_jobs import TrainingJobs
from atelier.local.sagemaker.validation import ApiError, sagemaker_model

logger = logging.getLogger(__name__)

JSON_CONTENT_TYPE = "application/x-amz-json-1.1"
TARGET_PREFIX = "SageMaker."
INVOCATIONS_PATH = re.compile(r"/endpoints/([^/]+)/invocations")


class SageMakerApp:
    """WSGI app: SageMaker's JSON 1.1 protocol (POST / with X-Amz-Target) and the Runtime's
    REST POST /endpoints/<name>/invocations, over the local jobs and endpoints."""

    def __init__(self, jobs: TrainingJobs, hosting: Hosting, tags: ResourceTags):
        self._operations: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "CreateTrainingJob": jobs.create, "DescribeTrainingJob": jobs.describe,
            "ListTrainingJobs": jobs.list_jobs, "StopTrainingJob": jobs.stop,
            "CreateModel": hosting.create_model, "DescribeModel": hosting.describe_model,
            "DeleteModel": hosting.delete_model, "ListModels": hosting.list_models,
            "CreateEndpointConfig": hosting.create_endpoint_config,
            "DescribeEndpointConfig": hosting.describe_endpoint_config,
            "DeleteEndpointConfig": hosting.delete_endpoint_config,
            "CreateEndpoint": hosting.create_endpoint, "DescribeEndpoint": hosting.describe_endpoint,
            "UpdateEndpoint": hosting.update_endpoint, "DeleteEndpoint": hosting.delete_endpoint,
            "ListEndpoints": hosting.list_endpoints,
            "AddTags": tags.add_tags, "ListTags": tags.list_tags, "DeleteTags": tags.delete_tags,
        }
        # botocore's model of each operation: AWS checks a request against it before the operation runs
        self.input_shapes = {name: sagemaker_model().operation_model(name).input_shape for name in self._operations}
        self._hosting = hosting

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        return self.respond(Request(environ))(environ, start_response)

    def respond(self, request: Request) -> Response:
        invocation = INVOCATIONS_PATH.fullmatch(request.path)
        if invocation and request.method == "POST":
            return self._invoke(unquote(invocation[1]), request)
        target = request.headers.get("X-Amz-Target", "")
        if request.method == "POST" and target.startswith(TARGET_PREFIX):
            return self._call(target.removeprefix(TARGET_PREFIX), request)
        return json_error(ApiError("UnknownOperationException", f"No SageMaker operation at {request.method} "
                                   f"{request.path}", 404))

    def _call(self, operation: str, request: Request) -> Response:
        handler = self._operations.get(operation)
        if handler is None:
            return json_error(ApiError("UnknownOperationException",
                                       f"The local SageMaker does not implement {operation}"))
        try:
            body = json.loads(request.get_data() or b"{}")
        except ValueError:
            return json_error(ApiError("SerializationException", "The request body is not JSON"))
        try:
            check_shape(self.input_shapes[operation], body)
            result = handler(body)
        except ApiError as error:
            return json_error(error)
        except Exception:  # answer as AWS does, keep serving
            logger.exception("SageMaker.%s failed", operation)
            return json_error(ApiError("InternalFailure", f"The local SageMaker failed on {operation}", 500))
        return Response(json.dumps(convert_times(result, epoch_seconds)), 200,
                        {"Content-Type": JSON_CONTENT_TYPE, "x-amzn-RequestId": str(uuid.uuid4())})

    def _invoke(self, endpoint: str, request: Request) -> Response:
        forwarded = {"Content-Type": request.headers.get("Content-Type", "application/octet-stream")}
        for header in ("Accept", "X-Amzn-SageMaker-Custom-Attributes"):
            if request.headers.get(header):
                forwarded[header] = request.headers[header]
        try:
            result = self._hosting.invoke(endpoint, request.get_data(), forwarded)
        except ApiError as error:
            return rest_error(error)
        headers = {"Content-Type": result.content_type, "x-Amzn-Invoked-Production-Variant": result.variant,
                   "x-amzn-RequestId": str(uuid.uuid4())}
        if result.custom_attributes:
            headers["X-Amzn-SageMaker-Custom-Attributes"] = result.custom_attributes
        return Response(result.body, 200, headers)


def json_error(error: ApiError) -> Response:
    """The JSON 1.1 error shape botocore turns into ClientError(code, message)."""
    body = {"__type": error.code, "message": error.message, **error.fields}
    return Response(json.dumps(body), error.status,
                    {"Content-Type": JSON_CONTENT_TYPE, "x-amzn-RequestId": str(uuid.uuid4())})


def rest_error(error: ApiError) -> Response:
    """The REST-JSON error shape of the Runtime: the code travels in x-amzn-ErrorType."""
    body = {"ErrorCode": error.code, "Message": error.message, **error.fields}
    return Response(json.dumps(body), error.status,
                    {"Content-Type": "application/json", "x-amzn-ErrorType": error.code,
                     "x-amzn-RequestId": str(uuid.uuid4())})
