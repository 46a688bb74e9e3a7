"""The local stack: moto in server mode, a runtime that delivers SQS and EventBridge events to the
handlers, and a local SageMaker."""
