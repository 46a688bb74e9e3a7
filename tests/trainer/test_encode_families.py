"""Latent shards of the transformer families (trainer/data/latents.py): the encode job stores what the family's
pipeline's encode_prompt gives, in bf16, and the empty caption's in every shard; a run on them loads no text
encoder, trains to the image shards' loss to bf16 rounding, and refuses shards of another text encoder.

Each family's base is a tiny pipeline built locally and saved with save_pretrained; nothing is downloaded."""

import shutil
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image
from safetensors.torch import load as load_safetensors
from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

from contracts.shard_members import EMPTY_CAPTION_KEY, TEXT, member_name
from trainer.data.captions import read_captions
from trainer.data.latents import LatentShardsError, models_identity, read_text, stored_text, text_member
from trainer.data.loader import StepBatches, make_loader
from trainer.data.plan import BatchPlan
from trainer.data.shards import index_shards
from trainer.data.phases import RunPlan
from trainer.jobs import train
from trainer.jobs.encode import encode_shards
from trainer.models.families import condition, negative_prompt, sampling_options
from trainer.models.loading import load_models
from trainer.models.pipelines import build_pipeline
from trainer.objectives.diffusion import diffusion_loss
from trainer.objectives.numerics import step_generator
from trainer.runtime.health import label_grid

from tests.trainer.encode_helpers import members_of

CPU = torch.device("cpu")
RESOLUTION = 32
BF16_STEP = 2 ** -7  # bf16 keeps 8 significant bits: a value rounded to it is within 2^-8 of itself, two within 2^-7


@pytest.fixture(scope="module", params=["tiny-sd3", "tiny-flux", "tiny-pixart"])
def family(request, tmp_path_factory, shards_dir) -> dict:
    """A tiny family pipeline saved as a base (tokenizers learned from the shards' captions), and the image
    shards encoded at 32 px by the models loaded from it."""
    root = tmp_path_factory.mktemp(request.param)
    built = load_models(request.param, None, seed=0, captions=lambda: read_captions(shards_dir))
    build_pipeline(built, built.denoiser, RESOLUTION).save_pretrained(root / "base")
    models = load_models(request.param, str(root / "base"), seed=0)
    encoded = encode_shards(shards_dir, root / "latents", models, RESOLUTION, CPU, batch_size=2, num_workers=0)
    return {"preset": request.param, "base": root / "base", "models": models, "encoded": encoded,
            "pipeline": DiffusionPipeline.from_pretrained(root / "base")}


def online(family: dict, caption: str) -> dict[str, torch.Tensor]:
    """What the saved pipeline's encode_prompt gives for one caption, by the names latent shards store."""
    return {name: tensor[0] for name, tensor
            in condition(family["models"].family, family["pipeline"], [caption], CPU).tensors().items()}


def assert_stored(stored: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Stored (bf16, padded back) is expected rounded to bf16, to one bf16 step (the encode job ran the captions in
    other batches); where a mask drops a position the stored embedding is zero."""
    assert stored.keys() == expected.keys()
    mask = expected.get("prompt_attention_mask")
    if mask is not None:
        assert torch.equal(stored["prompt_attention_mask"], mask)
    for name, tensor in expected.items():
        if tensor.is_floating_point():
            assert stored[name].dtype == torch.bfloat16
            kept = slice(None) if mask is None or name != "prompt_embeds" else mask.bool()
            torch.testing.assert_close(stored[name][kept].float(), tensor[kept].to(torch.bfloat16).float(),
                                       rtol=BF16_STEP, atol=1e-6)
            if mask is not None and name == "prompt_embeds":
                assert not stored[name][~mask.bool()].any()


def test_each_sample_stores_the_pipeline_s_embeddings_of_its_caption_in_bf16(family, samples):
    captions = {sample["key"]: sample["caption"] for sample in samples}
    members = members_of(Path(family["encoded"]["dir"]) / "shard-a.tar")
    keys = sorted(sample["key"] for sample in samples[:3])
    assert list(members) == [member_name(EMPTY_CAPTION_KEY, TEXT)] + [
        f"{key}.{extension}" for key in keys for extension in ("json", "latents.safetensors", "text.safetensors")]
    for key in keys:
        data = members[f"{key}.{TEXT}"]
        expected = online(family, captions[key])
        assert_stored(read_text(data), expected)
        raw = load_safetensors(data)  # as written: a masked family's embeddings cut after the caption's last token
        if "prompt_attention_mask" in expected:
            assert raw["prompt_embeds"].shape[0] == int(expected["prompt_attention_mask"].sum()) < 300
        else:
            assert raw["prompt_embeds"].shape == expected["prompt_embeds"].shape


def test_a_batch_cut_and_cast_before_the_host_copy_stores_the_same_bytes(family):
    """The encode job cuts a batch after the positions its captions hold and casts it on the device
    (`stored_text`), so a GPU copies a few percent of the padded tensors: each member is byte for byte what
    the whole batch gives, the full length included."""
    captions = ["a red circle on a blue background with a small green square beside it", "a cat", ""]
    conditioning = condition(family["models"].family, family["pipeline"], captions, CPU)
    whole = conditioning.tensors()
    cut = stored_text(whole, conditioning.positions)
    for number in range(len(captions)):
        assert (text_member({name: tensor[number] for name, tensor in cut.items()}, "identity")
                == text_member({name: tensor[number] for name, tensor in whole.items()}, "identity"))
    if conditioning.mask is None:  # SD3: no mask, every position kept
        assert conditioning.positions is None and cut["prompt_embeds"].shape == whole["prompt_embeds"].shape
    else:
        assert cut["prompt_embeds"].shape[1] == conditioning.positions == int(whole["prompt_attention_mask"].sum(1).max())
        assert conditioning.positions < whole["prompt_embeds"].shape[1]


def test_every_shard_opens_with_the_empty_caption_s_embeddings_and_indexes_leave_it_out(family, samples):
    target = Path(family["encoded"]["dir"])
    for shard in sorted(target.rglob("*.tar")):
        name, data = next(iter(members_of(shard).items()))
        assert name == "_empty-caption.text.safetensors"
        assert_stored(read_text(data), online(family, ""))
    for index in (index_shards(target), index_shards(target, index_dir=target / "no-tables")):  # tables, or a walk
        assert sorted(index.key) == sorted(sample["key"] for sample in samples) and not index.problems


def batches(channel, models, steps: int, dropout: float, latent: bool) -> list[dict]:
    index = index_shards(channel)
    plan = RunPlan([{"resolution": RESOLUTION, "batch_size": 2, "learning_rate": 1e-4, "steps": steps}])
    return list(make_loader(StepBatches(index, BatchPlan(index.aspect, plan, 0, 0, 1, models.size_multiple, True),
                                        1, steps, dropout, False, embeddings=latent), 0))


def test_a_step_on_latent_shards_gives_the_image_shards_loss_to_bf16_rounding(family, shards_dir):
    """The same draws from either kind of shard, captions half dropped: the loss differs by the bf16 rounding of the
    embeddings alone, at most 2^-9 of each value. Measured, that moves the loss by 2e-7 to 1e-5 of itself (both
    families, four steps); 1e-4 leaves ten times that, and is still a thousandth of the 5-15 % the loss moves
    from one batch to the next, so a wrong embedding, mask or empty caption fails it."""
    models = family["models"]
    image_batches = batches(shards_dir, models, steps=4, dropout=0.5, latent=False)
    latent_batches = batches(family["encoded"]["dir"], models, steps=4, dropout=0.5, latent=True)
    assert any("" in batch["caption"] for batch in image_batches)
    for step, (image_batch, latent_batch) in enumerate(zip(image_batches, latent_batches), start=1):
        assert image_batch["key"] == latent_batch["key"]
        expected = diffusion_loss(models.denoiser, models, image_batch, CPU, step_generator(0, step, 0, 0, CPU))
        got = diffusion_loss(models.denoiser, models, latent_batch, CPU, step_generator(0, step, 0, 0, CPU))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)


def test_training_on_latent_shards_loads_no_text_encoder_and_follows_the_image_shards_losses(tmp_path, family,
                                                                                             shards_dir, train_args,
                                                                                             monkeypatch):
    # GIVEN a count of the text encoders loaded, and a step that records it and the bundle's text encoders
    loads, seen, real_step = [], [], train.train_step
    for encoder_class in (T5EncoderModel, CLIPTextModel, CLIPTextModelWithProjection):
        monkeypatch.setattr(encoder_class, "from_pretrained", counted(encoder_class.from_pretrained.__func__, loads))

    def recording(trainee, models, *args):
        seen.append((list(models.text_encoders), models._text_pipeline, len(loads)))
        return real_step(trainee, models, *args)

    monkeypatch.setattr(train, "train_step", recording)
    records = {}
    for kind, channel in (("image", shards_dir), ("latent", family["encoded"]["dir"])):
        # WHEN the family trains three steps from each kind of shard, the same seed, captions half dropped
        records[kind] = train.main(train_args(channel, tmp_path / kind / "model", tmp_path / kind / "ckpt", "--steps", "3",
                                              "--model-config", family["preset"], "--pretrained", str(family["base"]),
                                              "--caption-dropout", "0.5", "--final-weights", "trained"))
    # THEN the latent run never loaded nor held a text encoder (the image run loaded them from the base), and its
    # losses are the image run's to bf16 rounding (the first step as above; the next two after AdamW updates that
    # differ as little: measured 5e-6 of the loss at step 3, against the 1e-4 allowed)
    image_loads = seen[0][2]
    assert image_loads == len(family["models"].text_encoders) and all(encoders for encoders, *_ in seen[:3])
    assert seen[3:] == [([], None, image_loads)] * 3
    losses = {kind: [entry["loss"] for entry in record["history"]] for kind, record in records.items()}
    assert losses["latent"] == pytest.approx(losses["image"], rel=1e-4)
    # AND the saved pipeline holds the base's text encoders, as the image run's does
    saved = DiffusionPipeline.from_pretrained(tmp_path / "latent" / "model")
    assert torch.equal(online({**family, "pipeline": saved}, "a red dog")["prompt_embeds"],
                       online(family, "a red dog")["prompt_embeds"])


def counted(load, calls: list):
    """`load` (a from_pretrained) that appends to `calls` each time it runs."""
    return classmethod(lambda cls, *args, **kwargs: calls.append(cls) or load(cls, *args, **kwargs))


def test_the_identity_without_the_text_encoders_is_the_encode_job_s(family):
    without = load_models(family["preset"], str(family["base"]), seed=0, text_encoders=False)
    assert without.text_encoders == [] and len(without.tokenizers) == len(family["models"].tokenizers)
    assert models_identity(without) == models_identity(family["models"]) == family["encoded"]["identity"]
    preset = load_models(family["preset"], None, seed=0)  # built from a preset: the configs, seed and versions
    assert models_identity(load_models(family["preset"], None, seed=0, text_encoders=False)) == models_identity(preset)
    assert models_identity(preset) != models_identity(load_models(family["preset"], None, seed=1))


def test_latent_shards_of_another_text_encoder_are_refused(tmp_path, family, train_args):
    # GIVEN the base with its first text encoder's weights drawn again from another seed, all else the same
    other = tmp_path / "other-base"
    shutil.copytree(family["base"], other)
    models = family["models"]
    folder = models.text_folders[0][0]
    torch.manual_seed(1)
    encoder = type(models.text_encoders[0])(models.text_encoders[0].config)
    shutil.rmtree(other / folder)
    encoder.save_pretrained(other / folder)
    # WHEN a run on the latent shards takes that base THEN it is refused before any step
    args = train_args(family["encoded"]["dir"], tmp_path / "model", tmp_path / "ckpt", "--steps", "1",
                      "--model-config", family["preset"], "--pretrained", str(other))
    with pytest.raises(LatentShardsError, match="encoded by models .* not by this run's .*another VAE, text encoder"):
        train.main(args)


def test_a_run_on_latent_shards_draws_its_validation_grid_from_the_prompts_embeddings(tmp_path, family, train_args):
    # GIVEN prompts and seeds for the validation grid, and the saved base pipeline with its text encoders
    prompts, seeds = ["a red dog", "a blue cat on a green field"], [0, 1]
    # WHEN the family trains two steps on latent shards with a checkpoint at step 2
    train.main(train_args(family["encoded"]["dir"], tmp_path / "model", tmp_path / "ckpt", "--steps", "2",
                          "--model-config", family["preset"], "--pretrained", str(family["base"]),
                          "--checkpoint-every", "2", "--validation-prompts", "|".join(prompts),
                          "--validation-seeds", "0,1", "--validation-inference-steps", "2"))
    # THEN the grid is drawn, one row per prompt and one column per seed
    grid = Image.open(tmp_path / "model" / "health" / "validation" / "step-00000002.png")
    blank = Image.new("RGB", (RESOLUTION, RESOLUTION))
    assert grid.size == label_grid([blank] * len(prompts) * len(seeds), prompts, seeds).size
    assert len(set(grid.crop((grid.size[0] - RESOLUTION, grid.size[1] - RESOLUTION, *grid.size)).getdata())) > 16
    # AND the embeddings it samples from give the pictures the pipeline with text encoders draws from the prompts
    models = load_models(family["preset"], str(family["base"]), seed=0, text_encoders=False)
    with_text, without = family["pipeline"], build_pipeline(models, models.denoiser, RESOLUTION)
    embeddings = models.stored_prompt_embeddings(prompts)
    assert models.text_encoders == []
    for seed in seeds:
        drawn = [pipeline(**text, num_inference_steps=2, height=RESOLUTION, width=RESOLUTION, output_type="pt",
                          generator=torch.Generator("cpu").manual_seed(seed), **sampling_options(pipeline)).images
                 for pipeline, text in ((with_text, {"prompt": prompts, "negative_prompt": negative_prompt(with_text, None)}),
                                        (without, {**embeddings, "negative_prompt": None}))]
        torch.testing.assert_close(drawn[1], drawn[0], rtol=0, atol=1e-5)


def test_the_summary_counts_the_captions_each_tokenizer_cuts(tmp_path, family, samples, write_shard):
    # GIVEN a shard whose one caption runs past every tokenizer's context (CLIP 77, SD3's T5 256, PixArt's 300,
    # Flux's 512)
    long = {**samples[0], "caption": "a red dog " * 200}
    write_shard(tmp_path / "shards" / "shard.tar", [long, *samples[1:3]])
    # WHEN it is encoded
    summary = encode_shards(tmp_path / "shards", tmp_path / "latents", family["models"], RESOLUTION, CPU, batch_size=2,
                            num_workers=0)
    # THEN each tokenizer of the pipeline counts that caption once
    folders = [tokenizer for _, tokenizer in family["models"].text_folders]
    assert summary["captions_cut"] == {folder: 1 for folder in folders} and folders
    assert family["encoded"]["captions_cut"] == {folder: 0 for folder in folders}
