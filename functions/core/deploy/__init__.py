"""Deploy stage: a finished job is evaluated, gated and rolled out blue/green to an endpoint.

In the order a model meets them: `events` (what an event says), `candidates` (a job becomes a
candidate), `evaluations` (its evaluation job; `gate` decides), `rollout` (the endpoint); `requests`
builds the SageMaker requests and `records` writes the table's items (docs/deploy.md).
"""
