"""The sweep stage: uploads whose notification never arrived, found and re-driven (SweepFunction)."""
