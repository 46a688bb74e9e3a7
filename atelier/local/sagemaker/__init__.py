"""The local SageMaker: the subset of the SageMaker and SageMaker Runtime APIs the pipeline uses.

moto's SageMaker completes jobs at once and sends no events, so the local stack serves these APIs
itself, on one loopback HTTP server speaking the real wire protocols. Pipeline code stays plain
boto3: it reaches this server through AWS_ENDPOINT_URL_SAGEMAKER and
AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME, while S3 and EventBridge stay on moto (AWS_ENDPOINT_URL).

    service.py            LocalSageMaker, start_local_sagemaker: the server and what it holds
    protocol.py           the JSON 1.1 and Runtime REST wire protocols (SageMakerApp)
    shape_checks.py       each request against botocore's model, as AWS checks it first
    training_jobs.py      training jobs in the API, their states and events
    training_run.py       one job's run: containers per instance, attempts, retries
    endpoints.py          models, endpoint configs, endpoints, InvokeEndpoint in the API
    serving.py            the serving containers and their supervisor
    rollout.py            blue/green deployments: traffic shifting, baking, rollback

See docs/local-sagemaker.md for every module and for what is emulated and what is not.
"""

from atelier.local.sagemaker.protocol import SageMakerApp
from atelier.local.sagemaker.service import LocalSageMaker, start_local_sagemaker
from atelier.local.sagemaker.settings import Settings

__all__ = ["LocalSageMaker", "SageMakerApp", "Settings", "start_local_sagemaker"]
