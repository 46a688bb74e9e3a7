"""Deploy stage: a finished job is evaluated, gated and rolled out blue/green to an endpoint."""
