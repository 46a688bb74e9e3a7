"""The tags the pipeline puts on what it creates in SageMaker (and on partner roles), read back
by the stages after it: the deploy stage, provenance, the CLI."""

from __future__ import annotations

# on every job the start-training stage creates (core.start_training.job_requests)
MANIFEST = "atelier:manifest"  # the digest of the manifest it trains on
LINEAGE = "atelier:lineage"
PLANNED_JOB = "atelier:stage"  # the run-plan job's name (the tag keeps its first spelling: recorded jobs carry it)
RECIPE = "atelier:recipe"  # the digest of the recipe it was started with (contracts.recipe_file)
FINAL_PLANNED_JOB = "atelier:final-stage"  # "true" on the run plan's last job, the one whose model is a deploy candidate
# on an encode, autoencoder, tokenizer or evaluation job: what it is, and the training job it runs for
ROLE = "atelier:role"
ENCODE, AUTOENCODER, EVALUATION = "encode", "autoencoder", "evaluation"  # the values of ROLE
TOKENIZER = "tokenizer"  # ... and the lineage's tokenizer job's (core.start_training.tokenizer_job)
TRAINING_JOB = "atelier:training-job"  # also on every SageMaker model the deploy stage creates
# on an evaluation job (core.deploy.requests): the model it judges, and what it is compared with
CANDIDATE = "atelier:candidate"
BASELINE = "atelier:baseline"
# on a partner's IAM role (core.partners.partner_access): which partner's uploads it may write
PARTNER = "atelier:partner"
