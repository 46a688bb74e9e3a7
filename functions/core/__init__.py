"""Atelier's pure, typed domain code, one subpackage per stage (ingest, pack, training, deploy) plus
reliability, partners, and the shared settings, telemetry, errors and AWS calls."""
