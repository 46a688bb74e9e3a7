"""Ingest stage: an uploaded object becomes a described, licensed sample or a quarantined upload."""
