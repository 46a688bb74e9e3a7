"""The local SageMaker: the subset of the SageMaker and SageMaker Runtime APIs the pipeline uses.

moto's SageMaker completes jobs at once and sends no events, so the local stack serves these APIs
itself, on one loopback HTTP server speaking the real wire protocols. Pipeline code stays plain
boto3: it reaches this server through AWS_ENDPOINT_URL_SAGEMAKER and
AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME, while S3 and EventBridge stay on moto (AWS_ENDPOINT_URL).

docs/local-sagemaker.md names every module and says what is emulated and what is not.
"""

from atelier.local.sagemaker.protocol import SageMakerApp
from atelier.local.sagemaker.service import LocalSageMaker, start_local_sagemaker
from atelier.local.sagemaker.settings import Settings

__all__ = ["LocalSageMaker", "SageMakerApp", "Settings", "start_local_sagemaker"]
