"""Where the pipeline keeps things in S3: every key prefix, and the keys built on them.

The data bucket holds what partners upload and what the pipeline makes of it (derivatives,
segments, shards, their indexes, manifests); the models bucket holds what the jobs make (job
output, checkpoints, latent shards, TensorBoard event files). template.yaml's policies and
lifecycle rules name the same prefixes.
"""

from __future__ import annotations

# --- the data bucket ----------------------------------------------------------------------------
DERIVED = "derived/"  # <sha256>.jpg: the re-encoded image of an upload whose own bytes cannot be kept
SEGMENTS = "segments/"  # <uuid>.tar and its <uuid>.json index: runs of samples waiting to be a shard
SHARDS = "shards/"  # <shard id>.tar: the sealed WebDataset shards
INDEXES = "indexes/"  # <shard id>.json: a shard's index sidecar (not under shards/: consumers list shards/ for tars)
INDEX_TABLE = ".table"  # <shard id>.table beside it: its sample table (contracts.shard_index), what jobs read at start
MANIFESTS = "manifests/"  # <job> + one of the MANIFEST_* suffixes below
IMPORTS = "imports/"  # <batch>/<tar>: the tars `atelier import` stages for the import stage
EVAL = "eval/"  # the held-out evaluation shards (the template's EvalDataPrefix default)

MANIFEST_JSON = ".json"  # the Manifest itself (the jobs' `manifest` channel, for its exclusion list)
MANIFEST_FILE = ".manifest"  # its SageMaker ManifestFile: the `train` channel
LATENTS_MANIFEST = ".latents.manifest"  # the ManifestFile of its latent twins (core.start_training.encode_job)
WIDS_LIST = ".wids.json"  # its shard list as wids opens it
INDEXES_MANIFEST = ".indexes.manifest"  # the ManifestFile of its shards' sample tables: the jobs' `indexes` channel
LATENT_INDEXES_MANIFEST = ".latents.indexes.manifest"  # ... and of its latent twins' tables

# --- the models bucket --------------------------------------------------------------------------
TRAINING = "training/"  # the training jobs' S3OutputPath: <job>/output/model.tar.gz and what lies beside it
EVALUATIONS = "evaluations/"  # the evaluation jobs' S3OutputPath (core.deploy.requests)
CHECKPOINTS = "checkpoints/"  # <lineage>/: one checkpoint prefix per lineage (<lineage>-ae/: its autoencoder's)
ENCODED = "encoded/"  # <job>/latents/<encoder identity>-r<res>/<shard path>: an encode job's latent shards
LATENTS = "latents/"  # below an encode job's checkpoint prefix, locally and in S3 (trainer/jobs/encode.py)
AUTOENCODER = "autoencoder/"  # the autoencoder jobs' S3OutputPath: <job>-ae/output/model.tar.gz
TOKENIZERS = "tokenizers/"  # the tokenizer jobs' S3OutputPath: <job>-tok/output/model.tar.gz
TENSORBOARD = "tensorboard/"  # <job>/: a training job's TensorBoard event files
# <file>: compiled shapes; at the bucket's root, the ones every lineage's training jobs read
# (core.start_training.compile_caches), and below a checkpoint prefix, the ones a lineage's jobs write (trainer/speed/compile_cache.py)
COMPILE_CACHE = "compile-cache/"
COMPILE_CACHE_SUFFIX = ".compile-cache"  # one compiled shape's file

MODEL_ARCHIVE = "model.tar.gz"  # a job's model, in <S3OutputPath><job>/output/
LINEAGE_FILE = "lineage.json"  # beside a training job's model: what it learned from (core.provenance)
ATTRIBUTION_FILE = "attribution.json"  # beside it too: its draws per partner (core.partners.attribution)
ATTRIBUTION_CHART = "attribution.png"  # and those draws as a bar chart
EVALUATION_FILE = "evaluation.json"  # the gate's scores: in an evaluation job's model, and beside the candidate
REPORT_FILE = "report.html"  # a training job's report, in its model and its output data (trainer/report/write.py)
TRAINING_RECORD = "atelier-training.json"  # a training job's record, at its model's root (trainer/jobs/train.py)


def uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def derived_key(sha256: str) -> str:
    return f"{DERIVED}{sha256}.jpg"


def segment_key(name: str) -> str:
    return f"{SEGMENTS}{name}.tar"


def shard_key(shard_id: str) -> str:
    return f"{SHARDS}{shard_id}.tar"


def index_key(shard_id: str) -> str:
    return f"{INDEXES}{shard_id}.json"


def table_key(shard_id: str) -> str:
    return f"{INDEXES}{shard_id}{INDEX_TABLE}"


def manifest_key(job: str, suffix: str = MANIFEST_JSON) -> str:
    """`manifests/<job><suffix>`: a manifest's files are named by the job that claimed it."""
    return f"{MANIFESTS}{job}{suffix}"


def import_key(batch_id: str, relative: str) -> str:
    return f"{IMPORTS}{batch_id}/{relative}"


def output_folder(job: str) -> str:
    """`training/<job>/output`: where a training job's model.tar.gz and what lies beside it are."""
    return f"{TRAINING}{job}/output"


def output_key(job: str, name: str) -> str:
    return f"{output_folder(job)}/{name}"


def output_uri(models_bucket: str, job: str, name: str) -> str:
    return uri(models_bucket, output_key(job, name))


def checkpoint_prefix(lineage: str) -> str:
    return f"{CHECKPOINTS}{lineage}/"


def lineage_compile_cache_prefix(lineage: str) -> str:
    """Where a lineage's training jobs leave their compiled shapes: `checkpoints/<lineage>/compile-cache/`."""
    return f"{checkpoint_prefix(lineage)}{COMPILE_CACHE}"


def encoded_prefix(training_job: str) -> str:
    """An encode job's checkpoint prefix: its latent shards are under `<this>latents/<identity>-r<res>/`."""
    return f"{ENCODED}{training_job}/"


def tensorboard_prefix(job: str) -> str:
    return f"{TENSORBOARD}{job}/"
