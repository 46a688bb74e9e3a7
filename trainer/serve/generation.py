"""The pipeline behind the endpoint: loaded (on the GPU in bf16 when there is one), its speed levers
applied (trainer/serve/levers.py) and the warm-up shapes compiled before /ping answers 200; then each
request's images from its own seeds, alone or in one call with requests of the same steps,
guidance and size.
"""

from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from PIL import Image

from trainer.models import lora
from trainer.models.families import (absent_parts, embedded_guidance, negative_prompt, note_training, position_cover,
                                     prepared, sampling_options, saved_record, size_multiple)
from trainer.serve.levers import apply_levers, compiled, denoiser_of, lever_plan
from trainer.serve.protocol import BadRequest, Generation
from trainer.serve.settings import ServeSettings

WARMUP_STEPS = 3  # CUDA graph trees warm up, record, then replay: the third UNet call replays


def load_pipeline(model_dir: str | Path, settings: ServeSettings = ServeSettings()) -> DiffusionPipeline:
    """The saved pipeline on the GPU in bf16 when there is one, else on the CPU in fp32, with the
    settings' speed levers applied and, when it compiles, the warm-up shapes compiled. A LoRA run's model
    (trainer/models/lora.py) is its base's pipeline with the adapter: the base's files are checked against
    the digest the adapter recorded (a mismatch refuses to serve), then the adapter is merged in fp32. A Flux
    without guidance embeddings guides unasked only where its training record says so (families.true_cfg)."""
    if not (Path(model_dir) / "model_index.json").is_file():  # never a hub id: diffusers would try to download it
        raise FileNotFoundError(f"no diffusers pipeline (model_index.json) in {model_dir}")
    adapter = lora.verified_adapter(Path(model_dir))
    pipeline = prepared(DiffusionPipeline.from_pretrained(str(model_dir), **absent_parts(Path(model_dir))))
    note_training(denoiser_of(pipeline), saved_record(Path(model_dir)))
    if adapter is not None:
        lora.merge_adapter(getattr(pipeline, adapter["denoiser"]), Path(model_dir), adapter)
    pipeline.set_progress_bar_config(disable=True)
    if torch.cuda.is_available():
        pipeline = pipeline.to("cuda", torch.bfloat16)
    plan = lever_plan(settings, torch.cuda.is_available())
    apply_levers(pipeline, plan)
    if compiled(plan):
        warm_up(pipeline, settings.warmup_images)
    return pipeline


def warm_up(pipeline: DiffusionPipeline, images_per_request: tuple[int, ...]) -> None:
    """Compile (and record the CUDA graphs of) each request size at the model's size and default guidance."""
    for images in images_per_request:
        for _ in range(2):  # the VAE decoder runs once a call: its graph records on the second
            _run(pipeline, Generation("warm-up", num_inference_steps=WARMUP_STEPS, num_images=images))


def generate(pipeline: DiffusionPipeline, generation: Generation) -> list[Image.Image]:
    """The request's images; image i draws its starting noise from seed + i. A shape the warm-up did
    not compile runs eagerly instead of compiling for minutes inside a request."""
    with torch.compiler.set_stance("eager_on_recompile"):
        return _run(pipeline, generation)


def _run(pipeline: DiffusionPipeline, generation: Generation) -> list[Image.Image]:
    return pipeline(
        generation.prompt,
        negative_prompt=negative_prompt(pipeline, generation.negative_prompt),
        num_inference_steps=generation.num_inference_steps,
        guidance_scale=generation.guidance_scale,
        height=generation.height,
        width=generation.width,
        num_images_per_prompt=generation.num_images,
        # CPU generators draw the same starting noise whatever device runs the model.
        generator=[torch.Generator("cpu").manual_seed(seed) for seed in generation.seeds],
        **sampling_options(pipeline, generation.guidance_scale, generation.negative_prompt),
    ).images


def check_request(pipeline: DiffusionPipeline, generation: Generation) -> None:
    """BadRequest for what this model cannot do (which the pipeline would fail on, a 500, or silently ignore): a
    side it cannot draw (a transformer's are multiples of its VAE's downsampling times its patch, and SD3's fit
    its position table), or a negative prompt for a model whose guidance is embedded (FLUX.1-dev's)."""
    if generation.negative_prompt is not None and embedded_guidance(pipeline):
        raise BadRequest('"negative_prompt" has no effect on this model: its guidance is an input of its transformer '
                         "(a guidance-distilled Flux), with nothing to guide away from")
    check_sides(pipeline, generation)


def check_sides(pipeline: DiffusionPipeline, generation: Generation) -> None:
    """BadRequest for a height or width this model cannot draw."""
    denoiser = denoiser_of(pipeline)
    multiple = size_multiple(denoiser, pipeline.vae_scale_factor)
    largest = position_cover(denoiser, pipeline.vae_scale_factor)
    for name in ("height", "width"):
        side = getattr(generation, name)
        if side is None:  # the model's own size
            continue
        if side % multiple:
            raise BadRequest(f'"{name}" must be a multiple of {multiple} for this model (its VAE\'s downsampling '
                             f"{pipeline.vae_scale_factor} x its patch of {multiple // pipeline.vae_scale_factor})")
        if largest and side > largest:
            raise BadRequest(f'"{name}" must be at most {largest} for this model (its position table)')


def batch_key(generation: Generation) -> tuple:
    """What requests sharing one pipeline call must agree on (prompts and seeds may differ)."""
    return (generation.num_inference_steps, generation.guidance_scale, generation.height, generation.width,
            generation.negative_prompt is None)


def generate_batch(pipeline: DiffusionPipeline, generations: list[Generation]) -> list[list[Image.Image]]:
    """Several requests of one batch_key as one pipeline call: each request's images, from its own seeds."""
    first = generations[0]
    prompts = [g.prompt for g in generations for _ in range(g.num_images)]
    negatives = None if first.negative_prompt is None else [g.negative_prompt for g in generations for _ in range(g.num_images)]
    with torch.compiler.set_stance("eager_on_recompile"):
        images = pipeline(
            prompts, negative_prompt=negative_prompt(pipeline, negatives, len(prompts)),
            num_inference_steps=first.num_inference_steps,
            guidance_scale=first.guidance_scale, height=first.height, width=first.width,
            generator=[torch.Generator("cpu").manual_seed(seed) for g in generations for seed in g.seeds],
            **sampling_options(pipeline, first.guidance_scale, negatives),
        ).images
    split, start = [], 0
    for generation in generations:
        split.append(images[start:start + generation.num_images])
        start += generation.num_images
    return split
