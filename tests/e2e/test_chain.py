"""The whole chain on the local stack: upload -> ingest -> pack -> autoencoder, tokenizer -> encode -> training
-> deploy -> image, with the demo's defaults (the procedural catalogue, samconfig.toml [local]).

One stack, one run (training is the slow part); each test reads one stage's outcome from it. The
last test runs every `atelier` command once against it, as a user would after `make demo`.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from PIL import Image

from atelier import client
from atelier.catalog import LICENSE, make_catalog, procedural_catalog, write_catalog
from atelier.cli import parser
from atelier.demo import PARTNER, DemoOptions, drive, kept_stack_banner
from atelier.prompt_match import DEMO_PROMPTS, GRID_PROMPTS, GRID_SEEDS, GUIDANCE, STEPS, grid_match_rate, match_rate
from atelier.local.stack import LocalStack, StackOptions
from contracts import pipeline_table
from contracts.messages import Manifest, ShardSealed
from core import aws
from tests.functions.import_helpers import sample_of, webdataset_tar
from tests.functions.test_cli_base import pipeline
from tests.unit.test_cli_text import commands

# The module fixture runs the whole demo, past 900 s on a loaded machine; the demo's stall detector catches a hang.
pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=360), pytest.mark.timeout(3000)]
REPO = Path(__file__).resolve().parents[2]
IMAGES = DemoOptions.images  # the demo's own run


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, dict, Path]]:
    state = tmp_path_factory.mktemp("stack")
    output = state / "image.png"
    options = StackOptions(root=REPO, state_dir=state, moto_port=0, sagemaker_port=0)
    # The demo as `make demo` runs it: on the CPU threads and processes recipes/local.toml gives its jobs, whatever
    # share of the cores a pytest-xdist worker got (the grid depends on their arithmetic, the same here as in the demo).
    with LocalStack(options) as stack:
        lines = drive(stack, DemoOptions(root=REPO, state_dir=state, output=output, images=IMAGES, grid=True))
        yield stack, lines, output


@pytest.fixture(autouse=True)
def stack_env(chain: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point boto3 at the local stack again (the shared fixtures clear AWS_ENDPOINT_URL*)."""
    for key, value in chain[0].env.items():
        monkeypatch.setenv(key, value)


def test_every_upload_is_accepted_and_recorded(chain: Any) -> None:
    stack, _, _ = chain
    status = client.pipeline_status(stack.outputs)
    assert dict(status.uploads) == {"accepted": IMAGES}
    assert status.samples == IMAGES and status.packed == IMAGES


def test_shards_hold_exactly_the_uploaded_images_once(chain: Any) -> None:
    stack, _, _ = chain
    s3 = boto3.client("s3")
    bucket = stack.outputs["DataBucketName"]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="shards/")["Contents"]]
    images: list[bytes] = []
    for key in keys:
        with tarfile.open(fileobj=io.BytesIO(s3.get_object(Bucket=bucket, Key=key)["Body"].read())) as tar:
            names = tar.getnames()
            images += [tar.extractfile(n).read() for n in names if n.rsplit(".", 1)[1] in {"png", "jpg", "webp"}]
            assert len(names) == 3 * (len(names) // 3)
    assert sorted(images) == sorted(item.image for item in procedural_catalog(3)[:IMAGES])


def test_one_training_job_ran_on_the_sealed_shards_with_the_sagemaker_contract(chain: Any) -> None:
    stack, _, _ = chain
    sagemaker = boto3.client("sagemaker")
    every = sagemaker.list_training_jobs()["TrainingJobSummaries"]
    jobs = [j for j in every if not j["TrainingJobName"].endswith(("-eval", "-enc", "-ae", "-tok"))]
    # one training job, the autoencoder, tokenizer and encode jobs before it (samconfig [local]) and the gate's evaluation
    assert [j["TrainingJobStatus"] for j in jobs] == ["Completed"]
    name = jobs[0]["TrainingJobName"]
    assert sorted(j["TrainingJobName"] for j in every) == sorted([name, f"{name}-ae", f"{name}-tok", f"{name}-enc",
                                                                  f"{name}-eval"])
    assert sagemaker.describe_training_job(TrainingJobName=f"{name}-enc")["TrainingJobStatus"] == "Completed"
    job = sagemaker.describe_training_job(TrainingJobName=name)
    encode = sagemaker.describe_training_job(TrainingJobName=f"{name}-enc")
    claimed = claimed_shards(stack, name)
    # the encode job read the image shards; the training job their latent twins
    for request, kind in ((encode, "image"), (job, "latent")):
        channel = request["InputDataConfig"][0]
        assert channel["InputMode"] == "FastFile"
        assert channel["DataSource"]["S3DataSource"]["S3DataDistributionType"] == "ShardedByS3Key"
        bucket, key = channel["DataSource"]["S3DataSource"]["S3Uri"].removeprefix("s3://").split("/", 1)
        manifest = json.loads(boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read())
        assert sorted(manifest[1:]) == sorted(shard_key.removeprefix("shards/") for shard_key in claimed)
        members = _members(manifest[0]["prefix"] + manifest[1])
        assert any(m.endswith(".latents.safetensors") for m in members) == (kind == "latent"), members
        assert any(m.endswith((".png", ".jpg", ".webp")) for m in members) == (kind == "image"), members
    assert job["ModelArtifacts"]["S3ModelArtifacts"].endswith(f"{job['TrainingJobName']}/output/model.tar.gz")
    # checkpoints were synced to the job's checkpoint URI
    ck_bucket, ck_prefix = job["CheckpointConfig"]["S3Uri"].removeprefix("s3://").split("/", 1)
    checkpoints = boto3.client("s3").list_objects_v2(Bucket=ck_bucket, Prefix=ck_prefix).get("Contents", [])
    assert any(o["Key"].endswith("latest") for o in checkpoints)
    # recipes/local.toml's cpu-processes: two data-parallel processes of one thread, under torchrun
    events = [json.loads(line) for line in (stack.options.state_dir / "sagemaker" / "jobs" / name / "algo-1" / "logs.txt")
              .read_text().splitlines() if line.startswith("{")]
    assert [e["world_size"] for e in events if e.get("event") == "start"] == [2] and {"event": "cpu_processes", "processes": 2} in events


def claimed_shards(stack: LocalStack, name: str) -> list[str]:
    """The shard keys the job's manifest lists, checked against the claim rule (docs/training-jobs.md,
    "Starting a job"): the `TrainingQuota` oldest sealed shards (the lineage's first job: no replay), each in
    the data bucket and claimed by this job. A shard sealed later (the pack stage seals a shard that has waited
    `SHARD_MAX_AGE_S` half full, as on a slow machine) is no part of it: it is the next job's."""
    table, data = stack.outputs["PipelineTableName"], stack.outputs["DataBucketName"]
    quota = int(stack.provisioned.functions["StartTrainingFunction"].environment["TRAINING_QUOTA"])
    record = aws.get_item(table, pipeline_table.job_pk(name))
    manifest = Manifest.model_validate_json(aws.read_object(data, record["manifest"]))
    listed = {s.shard_id: s.key for s in manifest.shards}
    in_bucket = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=data, Prefix="shards/")["Contents"]}
    sealed = [(i, ShardSealed.model_validate_json(i["record"])) for i in aws.scan_prefix(table, pipeline_table.SHARD_PREFIX)]
    order = {shard.shard_id: (shard.sealed_at, shard.shard_id) for _, shard in sealed}

    # the quota, of shards each sealed into the bucket and claimed by this job
    assert len(manifest.new_shards) == len(manifest.shards) == quota
    assert {shard.key for _, shard in sealed} == in_bucket and set(listed.values()) <= in_bucket
    assert {shard.shard_id for item, shard in sealed if item.get("manifest_job") == name} == set(listed)
    # the oldest: any other shard was sealed after all of them, the next job's (pending, or claimed by one queued after)
    later = set(order) - set(listed)
    assert all(order[shard_id] > max(order[s] for s in listed) for shard_id in later), (later, listed)
    assert all(item["status"] == "pending" or item.get("manifest_job") not in {None, name}
               for item, shard in sealed if shard.shard_id in later), sealed
    return sorted(listed.values())


def _members(uri: str) -> list[str]:
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    body = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        return tar.getnames()


def test_the_autoencoder_job_trained_the_vae_every_later_job_used(chain: Any) -> None:
    stack, _, _ = chain
    sagemaker = boto3.client("sagemaker")
    name = next(j["TrainingJobName"] for j in sagemaker.list_training_jobs()["TrainingJobSummaries"]
                if j["TrainingJobName"].endswith("-ae"))
    vae = sagemaker.describe_training_job(TrainingJobName=name)["ModelArtifacts"]["S3ModelArtifacts"]
    training = name.removesuffix("-ae")
    for job in (f"{training}-enc", training):
        request = sagemaker.describe_training_job(TrainingJobName=job)
        channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in request["InputDataConfig"]}
        assert channels["vae"] == vae and request["HyperParameters"]["vae"] == "vae"
    bucket, key = vae.removeprefix("s3://").split("/", 1)
    with tarfile.open(fileobj=io.BytesIO(boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read())) as tar:
        record = json.load(tar.extractfile("autoencoder.json"))
    # reconstructions of held-out pictures beat the untrained VAE's and an all-zeros guess by far
    assert record["held_out"] and record["psnr_db"] >= 20 and record["psnr_db"] > record["psnr_db_initial"] + 8
    assert record["psnr_db"] > record["psnr_db_zeros"] + 8


def test_the_tokenizer_job_learned_the_tokenizer_every_later_job_used_from_the_captions(chain: Any) -> None:
    sagemaker = boto3.client("sagemaker")
    name = next(j["TrainingJobName"] for j in sagemaker.list_training_jobs()["TrainingJobSummaries"]
                if j["TrainingJobName"].endswith("-tok"))
    learned = sagemaker.describe_training_job(TrainingJobName=name)["ModelArtifacts"]["S3ModelArtifacts"]
    training = name.removesuffix("-tok")
    for job in (f"{training}-enc", training):
        request = sagemaker.describe_training_job(TrainingJobName=job)
        channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in request["InputDataConfig"]}
        assert channels["tokenizer"] == learned and request["HyperParameters"]["tokenizer"] == "tokenizer"
    bucket, key = learned.removeprefix("s3://").split("/", 1)
    with tarfile.open(fileobj=io.BytesIO(boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read())) as tar:
        figures = json.load(tar.extractfile("tokenization.json"))["tokenizers"]["tokenizer"]
    # every demo picture's caption (none left in a shard still open); short, their few words repeat: a token each, none cut
    assert figures["captions"] == IMAGES and figures["tokens_per_word"] <= 1.6 and figures["cut_share"] == 0


@pytest.fixture(scope="module")
def untrained(chain: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The deployed pipeline with its UNet re-initialised: the same VAE, text encoder, tokenizer and sampler."""
    from diffusers import DiffusionPipeline, UNet2DConditionModel
    import torch
    stack, lines, _ = chain
    with pytest.MonkeyPatch.context() as patch:  # a module fixture comes before the autouse stack_env
        for key, value in stack.env.items():
            patch.setenv(key, value)
        model = boto3.client("sagemaker").describe_training_job(
            TrainingJobName=next(j["name"] for j in lines[0]["config"]["jobs"] if j["role"] == "train"))
        bucket, key = model["ModelArtifacts"]["S3ModelArtifacts"].removeprefix("s3://").split("/", 1)
        archive = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    folder = tmp_path_factory.mktemp("untrained")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    pipeline = DiffusionPipeline.from_pretrained(folder)
    torch.manual_seed(0)
    pipeline.unet = UNet2DConditionModel.from_config(pipeline.unet.config)
    return pipeline


def drawn(pipeline: Any, prompt: str, seed: int) -> bytes:
    import torch
    buffer = io.BytesIO()
    pipeline(prompt, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
             generator=torch.Generator().manual_seed(seed)).images[0].save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_model_draws_the_prompts_colours_and_an_untrained_one_does_not(chain: Any, untrained: Any) -> None:
    stack, lines, output = chain
    rate = next(line for line in lines if line["metric"] == "demo.prompt_match_rate")
    assert rate["unit"] == "share" and rate["config"]["prompts"] == len(DEMO_PROMPTS) >= 8
    assert rate["value"] >= 0.8, rate
    assert match_rate([("a red circle on a blue background", output.read_bytes())]) == 1.0  # the saved image
    # an untrained UNet with the same VAE, text encoder and prompts matches about as often as chance (1 in 30)
    assert match_rate([(prompt, drawn(untrained, prompt, 0)) for prompt in DEMO_PROMPTS]) <= 0.25


def test_the_model_draws_most_of_the_catalogue_grid_and_an_untrained_one_near_chance(chain: Any, untrained: Any) -> None:
    """Every shape x foreground x background, GRID_SEEDS seeds each, colours and shape (atelier/prompt_match.py; chance
    1 in 90). The issue's goal is the floor: the recipe drew 0.933 in `make demo` and 0.906 on both bench seeds
    (bench/RESULTS.md, "The demo's UNet in two processes"), its processes' arithmetic fixed at one thread each."""
    stack, lines, output = chain
    grid = next(line for line in lines if line["metric"] == "demo.prompt_match_grid")
    assert grid["config"]["prompts"] == len(GRID_PROMPTS) == 90 and grid["config"]["seeds"] == list(GRID_SEEDS)
    assert grid["value"] >= 0.9, grid
    assert grid_match_rate([(prompt, drawn(untrained, prompt, seed)) for prompt in GRID_PROMPTS for seed in GRID_SEEDS]) <= 0.05


def test_the_endpoint_serves_the_trained_model_and_draws_a_png(chain: Any) -> None:
    stack, lines, output = chain
    result = lines[0]
    endpoint = boto3.client("sagemaker").describe_endpoint(EndpointName=stack.outputs["EndpointName"])
    assert endpoint["EndpointStatus"] == "InService"
    assert endpoint["EndpointConfigName"] == next(j["name"] for j in result["config"]["jobs"] if j["role"] == "train")
    image = Image.open(output)
    assert image.format == "PNG" and image.size[0] > 0 and image.mode == "RGB"
    again = client.generate(stack.outputs["EndpointName"], "a green square on a white background", seed=1, steps=2)
    assert Image.open(io.BytesIO(again)).size == image.size


def test_the_server_settings_of_the_template_reach_the_endpoints_container(chain: Any) -> None:
    stack, lines, _ = chain
    model = next(j["name"] for j in lines[0]["config"]["jobs"] if j["role"] == "train")
    # recipes/local.toml: serve.environment ={"SERVE_CPU_THREADS": "1"}, through DeployFunction's CreateModel
    environment = boto3.client("sagemaker").describe_model(ModelName=model)["PrimaryContainer"]["Environment"]
    assert environment["SERVE_CPU_THREADS"] == "1"
    logs = stack.options.state_dir / "sagemaker" / "endpoints" / stack.outputs["EndpointName"] / model / "logs.txt"
    serving = [json.loads(line) for line in logs.read_text().splitlines() if line.startswith('{"event": "serving"')]
    assert [event["cpu_threads"] for event in serving] == [1]


def test_the_benchmark_lines_have_the_fixed_metric_names(chain: Any) -> None:
    _, lines, _ = chain
    assert [line["metric"] for line in lines] == ["demo.upload_to_image_s", "demo.prompt_match_rate", "demo.prompt_match_grid"]
    assert lines[0]["unit"] == "s" and lines[0]["value"] > 0


def test_the_cli_reads_the_same_status_through_aws_apis_only(chain: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from atelier.cli import main
    assert main(["status", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["uploads"] == {"accepted": IMAGES} and printed["endpoints"][0]["status"] == "InService"


def test_the_commands_a_kept_demo_prints_reach_its_stack_from_a_fresh_shell(chain: Any, tmp_path: Path) -> None:
    # GIVEN a shell with no AWS setting, `atelier` on its PATH, and what `atelier demo --keep` prints
    stack, _, _ = chain
    commands = [line.strip() for line in kept_stack_banner(stack.options.state_dir) if line.startswith("  ")]
    shell = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    shell["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{shell['PATH']}"
    status, generate, exports = commands

    def run(script: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=shell, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (script, done.stderr)
        return done

    # WHEN each runs as printed; THEN each reaches the demo's stack
    assert "InService" in run(status).stdout
    run(generate)
    assert Image.open(tmp_path / "out.png").format == "PNG"
    after = run(f"{exports}\natelier status --json").stdout  # the exports alone point atelier at it
    assert json.loads(after)["endpoints"][0]["status"] == "InService"


# --- every command once, as a user runs them after the demo ---------------------------------------

# Not run here: each starts a stack of its own (tests/e2e/test_cli.py runs `local up`, `make demo` the demo).
NOT_RUN = {"local up", "demo"}
# Refused, in one sentence, in this state: one model was deployed, so there is none to roll back
# to, and only an eval-failed model is evaluated again.
REFUSED = {"rollback", "evaluate"}


def run_cli(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`atelier --local ARGS` in its own process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "atelier.cli", "--local", "--state-dir", str(state), *args],
                          capture_output=True, text=True, timeout=600, cwd=REPO)


def queues_in_flight(stack: LocalStack) -> dict[str, int]:
    """Messages waiting or being handled (a handler that keeps failing holds one) on every queue a function reads."""
    sqs = boto3.client("sqs")
    counts = {}
    for source in stack.provisioned.sources:
        attributes = sqs.get_queue_attributes(QueueUrl=source.queue_url, AttributeNames=[
            "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
        counts[source.queue_url.rsplit("/", 1)[-1]] = sum(int(v) for v in attributes.values())
    return counts


def test_every_cli_command_runs_once_without_a_traceback_and_leaves_no_dead_letter(chain: Any, tmp_path: Path) -> None:
    # Runs last: it uploads, imports and revokes, which the tests above must not see.
    stack, lines, output = chain
    state = output.parent
    job = next(j["name"] for j in lines[0]["config"]["jobs"] if j["role"] == "train")
    endpoint = stack.outputs["EndpointName"]
    model = client.models(stack.outputs)[-1]["model"]
    ran: dict[str, subprocess.CompletedProcess[str]] = {}

    def ok(command: str, *args: str) -> subprocess.CompletedProcess[str]:
        result = run_cli(state, *command.split(), *args)
        assert result.returncode == 0 and "Traceback" not in result.stderr, (command, args, result.stderr)
        ran[command] = result
        return result

    def refused(command: str, *args: str) -> None:
        result = run_cli(state, *command.split(), *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, (command, args, result.stderr)
        assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: "), result.stderr
        ran[command] = result

    # GIVEN the files a user brings: a note that is no image, a base, a held-out set, a shard that
    # repeats an uploaded picture
    (tmp_path / "notes.txt").write_text("not an image")
    base = pipeline(tmp_path / "base")
    write_catalog(make_catalog(2), tmp_path / "heldout")
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "again.tar").write_bytes(webdataset_tar([sample_of("again", procedural_catalog(3)[0])]))

    # WHEN every command runs once: those that read first, then those that write
    assert "export AWS_ENDPOINT_URL=" in ok("local env").stdout
    ok("audit", "-q")
    ok("status")
    ok("models")
    found = json.loads(ok("lineage", endpoint, "--json").stdout)  # ListTags: the model's training job
    assert found["job"] == job
    ok("attribution", model)
    ok("report", "--partner", PARTNER)
    ok("report", "--job", job, "-o", str(tmp_path / "report.html"))
    ok("tensorboard", job, "--dir", str(tmp_path / "tensorboard"))
    assert any((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    ok("partner list", "--json")
    shown = ok("recipe show")  # recipes/local.toml's, as `atelier local up` set it
    recipe = json.loads(shown.stdout)
    assert recipe["training"]["run_plan"] == [] and shown.stderr.startswith("recipe ")
    ok("dlq show", "DeployDLQ")
    ok("generate", "a red circle on a blue background", "-o", str(tmp_path / "drawn.png"), "--steps", "2")
    refused("rollback")
    refused("evaluate", model)
    ok("partner add", "e2e-partner", "--license", LICENSE, "--principal", "arn:aws:iam::123456789012:role/e2e-uploader")
    assert 'prefix = "e2e-partner/"' in ok("partner export", "e2e-partner").stdout
    ok("upload", str(tmp_path / "notes.txt"), "--partner", PARTNER)
    ok("base add", str(base), "--name", "e2e-base")
    (tmp_path / "recipe.json").write_text(json.dumps({**recipe, "evaluation": {**recipe["evaluation"], "max_loss": 3.0}}))
    assert ok("recipe set", str(tmp_path / "recipe.json")).stdout.startswith("s3://")
    ok("evalset add", str(tmp_path / "heldout"), "--partner", PARTNER, "--name", "e2e-heldout")
    ok("import", str(tmp_path / "shards"), "--partner", PARTNER, "--license", LICENSE, "--wait", "--batch", "e2e-cli")
    assert json.loads(ok("import-report", "e2e-cli", "--json").stdout)["samples_duplicate"] == 1
    ok("lineage resume", found["lineage"])  # `lineage resume NAME` is the same command as `lineage MODEL`
    revoked = json.loads(ok("takedown", "--partner", PARTNER, "--sha256", found["samples"][0]["sha256"],
                            "--reason", "e2e: one sample revoked", "--json").stdout)
    assert [a["job"] for a in revoked["affected"]] == [job] and revoked["models"][job]  # ListModels + ListTags
    ok("dlq redrive", "DeployDLQ")

    # THEN once every function is idle (the note ingested and quarantined), no queue holds a message
    deadline = time.monotonic() + 180
    while (any(queues_in_flight(stack).values()) or sum(client.pipeline_status(stack.outputs).uploads.values())
           < IMAGES + 1) and time.monotonic() < deadline:
        time.sleep(2)
    assert {name: n for name, n in queues_in_flight(stack).items() if n} == {}
    dead = json.loads(ok("dlq list", "--json").stdout)
    assert len(dead) >= 7 and {d["name"]: d["messages"] for d in dead if d["messages"]} == {}
    # AND nothing was left out: every command of the CLI ran (`lineage resume` is `lineage`'s)
    every = {" ".join(path[1:]) for path, command in commands(parser()) if not command._subparsers}
    assert set(ran) | NOT_RUN | {"lineage resume"} >= every and set(ran) - {"lineage resume"} <= every
    assert REFUSED <= set(ran)
