"""A training job's self-contained report.html: the renderer and the trainer's writer."""
