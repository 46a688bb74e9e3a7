"""Atelier's pure, typed domain code, one subpackage per stage, named like the handler folder that uses it
(ingest, pack, import_shard, start_training, deploy, sweep, redrive), plus partners and the shared settings,
telemetry, errors and AWS calls."""
