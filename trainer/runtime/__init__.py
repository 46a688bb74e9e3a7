"""What keeps a job running and accountable: processes, checkpoints, health, logs, watchdogs, the run's state."""
