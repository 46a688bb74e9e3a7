"""`atelier demo`: the whole chain on the local stack, from a partner's upload to a generated image.

Starts the local stack, makes a procedural licensed catalogue (shapes x colours x backgrounds,
captions from the attributes), uploads it through the S3 API as a partner would, follows each stage
(ingest, shards, the autoencoder job, encode, training, the gate, the endpoint) until the endpoint
answers, and saves the image. Then it asks the endpoint for every prompt of DEMO_PROMPTS, half of
them combinations no training picture shows, and scores the pictures with a pixel classifier
(atelier/prompt_match.py): `demo.prompt_match_rate`. A stage in which nothing moves (no status
change, no new line in a running job's log) for stage_timeout_s ends the demo with the reason and the
logs to read.
"""

from __future__ import annotations

import io
import json
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.progress import Progress, TaskID

from PIL import Image, ImageDraw

from atelier import client, evalset
from atelier.catalog import DEMO_IMAGES, EVAL_IMAGES, LICENSE, UNSEEN, procedural_catalog, training_combinations, write_catalog
from atelier.prompt_match import DEMO_PROMPTS, GRID_PROMPTS, GRID_SEEDS, GUIDANCE, PROMPT, STEPS, matches, matches_grid
from atelier.local.stack import LocalStack, StackOptions
from atelier.progress import progress
from contracts import s3_layout

console = Console(stderr=True)
PARTNER = "demo-partner"


class DemoFailed(RuntimeError):
    """A stage failed or stalled; the message says which and where to look."""


@dataclass
class DemoOptions:
    root: Path
    state_dir: Path
    output: Path
    images: int = DEMO_IMAGES
    # a stall detector, not a time goal: a stage fails when neither the pipeline's status nor a running
    # job's log changed for this long, however long the stage takes on a slow or loaded machine
    stage_timeout_s: float = 900.0
    keep_running: bool = False
    quiet: bool = False  # no progress bar
    grid: bool = False  # also draw the whole catalogue grid (demo.prompt_match_grid: 180 pictures, minutes on a CPU)


def run_demo(options: DemoOptions) -> list[dict]:
    """Start a fresh local stack, drive the chain through it, stop it."""
    shutil.rmtree(options.state_dir, ignore_errors=True)
    with LocalStack(StackOptions(root=options.root, state_dir=options.state_dir, moto_port=0, sagemaker_port=0)) as stack:
        console.print(f"[bold]local stack up[/] (moto {stack.env['AWS_ENDPOINT_URL']}, "
                      f"SageMaker {stack.env['AWS_ENDPOINT_URL_SAGEMAKER']}); logs in {options.state_dir / 'logs'}")
        result = drive(stack, options)
        if options.keep_running:
            for line in kept_stack_banner(options.state_dir):
                console.print(line, soft_wrap=True, markup=False, highlight=False)  # one line each, to copy
            _wait_forever(stack)
        return result


def kept_stack_banner(state_dir: Path) -> list[str]:
    """How another shell reaches the kept stack: its state is the demo's, not `atelier local up`'s, so
    every command names the folder."""
    flag = f"--state-dir {shlex.quote(str(state_dir))}"
    return ["the stack keeps running; from another shell:",
            f"  atelier --local {flag} status",
            f"  atelier --local {flag} generate {shlex.quote(PROMPT)} -o out.png --steps {STEPS} --guidance {GUIDANCE}",
            f"  eval \"$(atelier {flag} local env)\"   # then boto3, the AWS CLI and atelier without --local",
            "Ctrl-C here (or SIGTERM, SIGHUP) stops it."]


def drive(stack: LocalStack, options: DemoOptions) -> list[dict]:
    """Upload the catalog, follow every stage, draw and save the image, score the prompts; the two
    benchmark lines (demo.upload_to_image_s, demo.prompt_match_rate)."""
    started = time.monotonic()
    _upload_catalog(stack, options.images)
    status = _follow(stack, options, started)
    endpoint = stack.outputs["EndpointName"]
    image = client.generate(endpoint, PROMPT, seed=0, steps=STEPS, guidance=GUIDANCE)
    elapsed = time.monotonic() - started
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_bytes(image)
    console.print(f"[bold green]done[/] in {elapsed:.0f} s: {PROMPT!r} -> {options.output}")
    results = [(prompt, image if prompt == PROMPT else client.generate(endpoint, prompt, seed=0, steps=STEPS, guidance=GUIDANCE))
               for prompt in DEMO_PROMPTS]
    matched = [matches(prompt, png) for prompt, png in results]  # the classifier, once per picture
    sheet = options.output.with_name("prompts.png")
    prompt_sheet(results, matched).save(sheet)
    rate = sum(matched) / len(results)
    console.print(f"prompt match rate {rate:.2f} over {len(results)} prompts ({len(UNSEEN)} never seen in training) -> {sheet}")
    commit = _commit(options.root)
    grid = [_grid_line(endpoint, commit)] if options.grid else []
    return [{"metric": "demo.upload_to_image_s", "value": round(elapsed, 1), "unit": "s",
             "config": {"images": options.images, "jobs": status.jobs}, "commit": commit},
            {"metric": "demo.prompt_match_rate", "value": round(rate, 3), "unit": "share",
             "config": {"prompts": len(results), "unseen": len(UNSEEN), "steps": STEPS, "seed": 0, "guidance": GUIDANCE,
                        "matched": [prompt for (prompt, _), hit in zip(results, matched) if hit]}, "commit": commit}] + grid


def _grid_line(endpoint: str, commit: str) -> dict:
    """Every shape x foreground x background of the catalogue, GRID_SEEDS seeds each, scored on colours and shape."""
    hits: dict[str, int] = {}
    for prompt in GRID_PROMPTS:
        for seed in GRID_SEEDS:
            png = client.generate(endpoint, prompt, seed=seed, steps=STEPS, guidance=GUIDANCE)
            hits[prompt] = hits.get(prompt, 0) + matches_grid(prompt, png)
    rate = sum(hits.values()) / (len(GRID_PROMPTS) * len(GRID_SEEDS))
    console.print(f"grid prompt match {rate:.2f} over {len(GRID_PROMPTS)} prompts x {len(GRID_SEEDS)} seeds (colours and shape)")
    return {"metric": "demo.prompt_match_grid", "value": round(rate, 3), "unit": "share",
            "config": {"prompts": len(GRID_PROMPTS), "seeds": list(GRID_SEEDS), "steps": STEPS, "guidance": GUIDANCE,
                       "missed": sorted(p for p, n in hits.items() if n < len(GRID_SEEDS))}, "commit": commit}


def prompt_sheet(results: list[tuple[str, bytes]], matched: list[bool], tile: int = 192) -> Image.Image:
    """Every prompt's picture, enlarged (NEAREST) under its prompt, with the classifier's verdict."""
    sheet = Image.new("RGB", (tile * 4, (tile + 36) * -(-len(results) // 4)), "white")
    draw = ImageDraw.Draw(sheet)
    for n, ((prompt, png), hit) in enumerate(zip(results, matched)):
        x, y = tile * (n % 4), (tile + 36) * (n // 4)
        with Image.open(io.BytesIO(png)) as picture:
            sheet.paste(picture.convert("RGB").resize((tile, tile), Image.Resampling.NEAREST), (x, y + 36))
        verdict = "match" if hit else "no match"
        unseen = " (unseen)" if n >= len(DEMO_PROMPTS) - len(UNSEEN) else ""
        draw.text((x + 4, y + 2), prompt.removeprefix("a ").replace(" background", ""), fill="black")
        draw.text((x + 4, y + 18), verdict + unseen, fill="darkgreen" if verdict == "match" else "darkred")
    return sheet


def _upload_catalog(stack: LocalStack, count: int) -> None:
    client.add_partner(stack.outputs, PARTNER, [LICENSE], [], "synthetic demo catalog")
    catalog = procedural_catalog(variants=-(-count // len(training_combinations())))[:count]
    with tempfile.TemporaryDirectory() as folder:
        write_catalog(procedural_catalog(1, seed=1)[:EVAL_IMAGES], Path(folder))  # held out: other pictures, never uploaded
        samples = evalset.samples_from_folder(Path(folder), PARTNER, (LICENSE,))
        uri = evalset.upload(samples, stack.outputs["DataBucketName"], s3_layout.EVAL, "demo-heldout")
    console.print(f"evaluation set: {EVAL_IMAGES} held-out images -> {uri}")
    with tempfile.TemporaryDirectory() as folder:
        write_catalog(catalog, Path(folder))
        keys = list(client.upload(Path(folder), PARTNER, stack.outputs["UploadsBucketName"]))
    console.print(f"uploaded {len(keys)} objects ({count} images with sidecars) as partner {PARTNER!r}")


def _follow(stack: LocalStack, options: DemoOptions, started: float) -> client.Status:
    """Wait for each stage in turn, printing progress; raise DemoFailed on failure or stall."""
    stages: list[tuple[str, Callable[[client.Status], bool]]] = [
        ("every upload ingested", lambda s: sum(s.uploads.values()) >= options.images),
        ("shards sealed", lambda s: sum(s.shards.values()) > 0),
        ("first job started (autoencoder, encode, then train)", lambda s: bool(s.jobs)),
        ("training job completed", lambda s: _job_done(s)),
        ("model passed the evaluation gate", lambda s: any(m["status"] in {"passed", "deployed"} for m in s.models)),
        ("endpoint in service", lambda s: any(e["status"] == "InService" for e in s.endpoints)),
    ]
    status = client.pipeline_status(stack.outputs)
    with progress(options.quiet) as bar:
        task, training = bar.add_task("stages", total=len(stages)), {}
        for name, reached in stages:
            bar.update(task, description=f"waiting: {name}")
            mark, moved = progress_mark(stack, status), time.monotonic()
            while not reached(status):
                stack.check()
                _fail_on_failure(status, stack)
                if not options.quiet:
                    _show_training(bar, stack, status, training)
                if (now := progress_mark(stack, status)) != mark:
                    mark, moved = now, time.monotonic()
                elif time.monotonic() - moved > options.stage_timeout_s:
                    raise DemoFailed(f"stalled waiting for: {name} (nothing moved in {options.stage_timeout_s:.0f} s); "
                                     f"status {json.dumps(status.to_json())}; logs in {stack.options.state_dir / 'logs'}")
                time.sleep(poll_interval(status))
                status = client.pipeline_status(stack.outputs)
            bar.console.print(f"[{time.monotonic() - started:5.0f} s] {name}: {_summary(status)}")
            bar.advance(task)
    return status


def progress_mark(stack: LocalStack, status: client.Status) -> str:
    """What changes while the chain moves: the pipeline's status and the log tail of each running job.
    A slow machine keeps changing it; a hung job or a lost event does not."""
    assert stack.sagemaker is not None
    logs = {job["name"]: stack.sagemaker.training_log_tail(job["name"], lines=2)
            for job in status.jobs if job["status"] == "InProgress"}
    return json.dumps([status.to_json(), logs], sort_keys=True)


def poll_interval(status: client.Status) -> float:
    """Seconds to the next status read: 5 while a job runs (each read scans the table, and on two
    cores the job wants the CPU), else 1."""
    return 5.0 if any(job["status"] == "InProgress" for job in status.jobs) else 1.0


def _show_training(bar: Progress, stack: LocalStack, status: client.Status, tasks: dict[str, TaskID]) -> None:
    """A bar per training job from its container log's last line: steps, img/s, the trainer's ETA."""
    assert stack.sagemaker is not None
    for job in status.jobs:
        if job.get("role") not in {"train", "autoencoder"} or job["status"] not in {"InProgress", "Completed"}:
            continue
        figures = training_figures(stack.sagemaker.training_log_tail(job["name"]))
        if figures is None:
            continue
        eta = "-" if figures["eta_s"] is None else f"{figures['eta_s']:.0f} s"
        if job["name"] not in tasks:
            tasks[job["name"]] = bar.add_task(job["name"], total=figures["steps"])
        bar.update(tasks[job["name"]], completed=figures["step"], total=figures["steps"],
                   description=f"{'training' if job.get('role') == 'train' else job.get('role')} {job['name']}: "
                               f"{figures['img_per_s']:g} img/s, trainer's eta {eta}")


def training_figures(log: str) -> dict | None:
    """The last training line (trainer/jobs/train.py: step, steps, progress, img_per_s, eta_s) in a log."""
    for line in reversed(log.splitlines()):
        start = line.find("{")
        if start < 0 or '"eta_s"' not in line:
            continue
        try:
            return json.loads(line[start:])
        except json.JSONDecodeError:  # the tail's first line may be cut
            continue
    return None


def _job_done(status: client.Status) -> bool:
    return any(j["status"] == "Completed" and j.get("role") == "train" for j in status.jobs)


def _fail_on_failure(status: client.Status, stack: LocalStack) -> None:
    for job in status.jobs:
        if job["status"] in {"Failed", "Stopped"}:
            raise DemoFailed(f"{job['role']} job {job['name']} {job['status']}: {job.get('failure')}; "
                             f"logs in {stack.options.state_dir / 'sagemaker'}")
    for endpoint in status.endpoints:
        if endpoint["status"] == "Failed":
            raise DemoFailed(f"endpoint {endpoint['name']} failed: {endpoint.get('failure')}")
    for model in status.models:
        if model["status"] in {"held-back", "eval-failed"}:
            raise DemoFailed(f"model {model['model']} {model['status']}: {model['reason']}; "
                             f"logs in {stack.options.state_dir / 'sagemaker'}")
    if status.quarantined:
        raise DemoFailed(f"uploads were quarantined: {dict(status.quarantined)}")


def _summary(status: client.Status) -> str:
    jobs = ", ".join(f"{j['name']} {j['status']}" for j in status.jobs) or "no job"
    endpoints = ", ".join(f"{e['name']} {e['status']}" for e in status.endpoints) or "no endpoint"
    return (f"uploads {dict(status.uploads)}, samples {status.samples} ({status.packed} packed), "
            f"shards {dict(status.shards)}, {jobs}, {endpoints}")


def _wait_forever(stack: LocalStack) -> None:
    try:
        while True:
            stack.check()
            time.sleep(2)
    except KeyboardInterrupt:
        pass


def _commit(root: Path) -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"
