"""Redrive stage: dead letters judged (dead_letters) and sent back or held as poison (redriver)."""
