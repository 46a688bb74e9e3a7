"""trainer.jobs.encode: latent shards hold exactly what the online path computes, and train to the same loss."""

import io
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from trainer.data.latents import LatentShardsError, latent_dir, models_identity
from trainer.data.loader import StepBatches, make_loader
from trainer.data.plan import BatchPlan
from trainer.data.shards import ShardReader, index_shards
from trainer.data.phases import RunPlan
from trainer.data.captions import NoCaptions, read_captions
from trainer.jobs import train
from trainer.jobs.encode import encode_shards
from trainer.models import text_tokenizers
from trainer.models.loading import load_models
from trainer.models.text import caption_ids
from trainer.objectives.diffusion import diffusion_loss
from trainer.objectives.numerics import step_generator

from tests.trainer.encode_helpers import members_of

CPU = torch.device("cpu")
RESOLUTION = 32


@pytest.fixture(scope="module")
def models(shards_dir):
    """The tiny preset (seed 0) with tokenizers learned from the shards' captions, as a job without --tokenizer learns them."""
    return load_models("tiny", None, seed=0, captions=lambda: read_captions(shards_dir))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, models) -> Path:
    """The models' tokenizers saved as a tokenizer job saves them: what latent shards' runs take as --tokenizer."""
    root = tmp_path_factory.mktemp("tokenizer")
    text_tokenizers.save(dict(zip(["tokenizer"], models.tokenizers)), root)
    return root


@pytest.fixture(scope="module")
def encoded(tmp_path_factory, shards_dir, models) -> dict:
    """The conftest image shards encoded at 32 px by the tiny model (seed 0)."""
    root = tmp_path_factory.mktemp("latents")
    return encode_shards(shards_dir, root, models, RESOLUTION, CPU, batch_size=2, num_workers=0)


def batches(channel, models, steps=3, dropout=0.0, latent=False):
    index = index_shards(channel)
    plan = RunPlan([{"resolution": RESOLUTION, "batch_size": 2, "learning_rate": 1e-4, "steps": steps}])
    empty_ids = caption_ids(models, [""])[0].numpy() if latent else None
    return list(make_loader(StepBatches(index, BatchPlan(index.aspect, plan, 0, 0, 1, models.size_multiple, True),
                                        1, steps, dropout, False, empty_ids), 0))


def test_latent_shards_mirror_the_image_shards_under_the_identity_and_resolution(encoded, shards_dir, models, samples):
    target = latent_dir(encoded["dir"].rsplit("/", 1)[0], models_identity(models), RESOLUTION)
    assert str(target) == encoded["dir"] and target.name == f"{models_identity(models)[:16]}-r32"
    assert sorted(p.relative_to(target).as_posix() for p in target.rglob("*.tar")) == ["nested/shard-b.tar", "shard-a.tar"]
    members = members_of(target / "shard-a.tar")
    keys = sorted(sample["key"] for sample in samples[:3])
    assert list(members) == [f"{key}.{ext}" for key in keys for ext in ("ids.npy", "json", "latents.safetensors")]
    by_key = {sample["key"]: sample for sample in samples}
    for key in keys:  # the record unchanged; the caption's ids as the tokenizer gives them
        assert members[f"{key}.json"] == json.dumps(by_key[key]["metadata"]).encode()
        ids = np.load(io.BytesIO(members[f"{key}.ids.npy"]))
        assert torch.equal(torch.from_numpy(ids), caption_ids(models, [by_key[key]["caption"]])[0])


def test_the_stored_posterior_and_its_latents_equal_the_online_path(encoded, shards_dir, models):
    # GIVEN the same step's batch read from the image shards and from the latent shards
    for image_batch, latent_batch in zip(batches(shards_dir, models), batches(encoded["dir"], models, latent=True)):
        assert image_batch["key"] == latent_batch["key"]
        # WHEN the online path encodes the images (the same bucket and crop)
        with torch.no_grad():
            online = models.vae.encode(image_batch["pixel_values"]).latent_dist
        # THEN the shard holds the posterior bit for bit, and the same seed draws the same latents
        assert torch.equal(latent_batch["latent_dist"], online.parameters)
        assert torch.equal(latent_batch["time_ids"], image_batch["time_ids"])
        stored = DiagonalGaussianDistribution(latent_batch["latent_dist"])
        assert torch.equal(stored.sample(torch.Generator().manual_seed(3)), online.sample(torch.Generator().manual_seed(3)))


def test_a_step_on_latent_shards_gives_the_image_shards_loss_exactly(encoded, shards_dir, models):
    # half the captions dropped: the empty caption's ids stand in for "" on latent shards
    image_batches = batches(shards_dir, models, steps=4, dropout=0.5)
    latent_batches = batches(encoded["dir"], models, steps=4, dropout=0.5, latent=True)
    assert any("" in batch["caption"] for batch in image_batches)
    for step, (image_batch, latent_batch) in enumerate(zip(image_batches, latent_batches), start=1):
        expected = diffusion_loss(models.denoiser, models, image_batch, CPU, step_generator(0, step, 0, 0, CPU))
        got = diffusion_loss(models.denoiser, models, latent_batch, CPU, step_generator(0, step, 0, 0, CPU))
        assert torch.equal(got, expected)


def test_training_on_latent_shards_logs_the_losses_and_ends_with_the_weights_of_image_shards(tmp_path, encoded, shards_dir,
                                                                                              train_args, tokenizer_dir):
    records = {}
    for kind, channel, tokenizer in (("image", shards_dir, []), ("latent", encoded["dir"], ["--tokenizer", str(tokenizer_dir)])):
        args = train_args(channel, tmp_path / kind / "model", tmp_path / kind / "checkpoints", "--steps", "2",
                          "--caption-dropout", "0.5", "--final-weights", "trained", *tokenizer)
        records[kind] = train.main(args)
    assert [h["loss"] for h in records["latent"]["history"]] == [h["loss"] for h in records["image"]["history"]]
    weights = [load_file(tmp_path / kind / "model" / "unet" / "diffusion_pytorch_model.safetensors") for kind in records]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


def test_a_second_encode_keeps_the_shards_already_written(tmp_path, encoded, shards_dir, models):
    again = encode_shards(shards_dir, encoded["dir"].rsplit("/", 1)[0], models, RESOLUTION, CPU, batch_size=2, num_workers=0)
    assert (again["dir"], again["shards_written"], again["samples_encoded"]) == (encoded["dir"], 0, 0)


def test_excluded_samples_are_never_read_nor_encoded_and_the_others_are_as_before(tmp_path, monkeypatch, encoded,
                                                                                 shards_dir, models, samples):
    # GIVEN a manifest that excludes one sample of shard-a, and a reader that records what it reads
    revoked = sorted(sample["key"] for sample in samples[:3])[1]
    read = []
    original = ShardReader.read
    monkeypatch.setattr(ShardReader, "read", lambda self, row: read.append(str(self.index.key[row])) or original(self, row))

    # WHEN the shards are encoded with that exclusion list
    result = encode_shards(shards_dir, tmp_path, models, RESOLUTION, CPU, batch_size=2, num_workers=0,
                           exclude={"shard-a": {revoked}})

    # THEN the revoked sample was never read, and no latent of it was written
    assert (result["samples_encoded"], result["samples_excluded"], result["corrupt"]) == (5, 1, [])
    assert revoked not in read and len(read) == 5
    # AND every other sample's members are what an encode without exclusions wrote, in the same order
    for shard in ("shard-a.tar", "nested/shard-b.tar"):
        before = members_of(f"{encoded['dir']}/{shard}")
        after = members_of(f"{result['dir']}/{shard}")
        assert list(after) == [name for name in before if not name.startswith(f"{revoked}.")]
        assert all(same_member(name, after[name], before[name]) for name in after)


def same_member(name: str, got: bytes, expected: bytes) -> bool:
    """Equal bytes; for a latents member equal tensors, bit for bit, and equal header metadata
    (safetensors writes the metadata's keys in a hash map's order, which changes from call to call)."""
    if not name.endswith(".latents.safetensors"):
        return got == expected
    tensors, wanted = load_safetensors(got), load_safetensors(expected)
    return (safetensors_metadata(got) == safetensors_metadata(expected) and tensors.keys() == wanted.keys()
            and all(torch.equal(tensors[key], wanted[key]) for key in wanted))


def safetensors_metadata(data: bytes) -> dict:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length])["__metadata__"]


def test_the_trainer_applies_the_exclusion_list_to_latent_shards_too(encoded, samples):
    # latent shards keep the sample keys and the shard ids: a twin encoded without the list is still filtered
    revoked = sorted(sample["key"] for sample in samples[:3])[1]
    index = index_shards(encoded["dir"], exclude={"shard-a": {revoked}})
    assert index.latent and index.excluded == 1
    assert sorted(index.key) == sorted(sample["key"] for sample in samples if sample["key"] != revoked)


def test_latent_shards_are_indexed_from_their_tables_as_walking_them_would(encoded, monkeypatch):
    # GIVEN the latent shards, each with the sample table the encode job wrote beside it
    target = Path(encoded["dir"])
    assert sorted(path.name for path in (target / "indexes").iterdir()) == ["shard-a.table", "shard-b.table"]
    walked = index_shards(target, index_dir=target / "no-tables")
    # WHEN they are indexed from their tables, with no tar walked
    from trainer.data import scan
    monkeypatch.setattr(scan, "IndexedTarSamples", lambda **kwargs: pytest.fail("a latent shard was walked"))
    index = index_shards(target)
    # THEN the samples, their buckets' aspects, their ranges and the encoding are the walk's
    assert (index.scanned, walked.scanned, index.encodings) == (0, 2, walked.encodings)
    for column in ("key", "aspect", "offset", "size"):
        assert getattr(index, column).tolist() == getattr(walked, column).tolist(), column


def test_the_trainer_refuses_latent_shards_of_other_models_or_another_resolution(tmp_path, encoded, train_args,
                                                                                 tokenizer_dir):
    tokenizer = ("--tokenizer", str(tokenizer_dir))
    other = train_args(encoded["dir"], tmp_path / "m1", tmp_path / "c1", "--steps", "1", "--seed", "1", *tokenizer)
    with pytest.raises(LatentShardsError, match="encoded by models .* not by this run's"):
        train.main(other)
    wrong_size = train_args(encoded["dir"], tmp_path / "m2", tmp_path / "c2", "--steps", "1", "--resolution", "64",
                            *tokenizer)
    with pytest.raises(LatentShardsError, match=r"latent shards at 32 px, but the run's phases are at \[64\] px"):
        train.main(wrong_size)


def test_latent_shards_without_their_tokenizer_are_refused_before_training(tmp_path, encoded, train_args):
    with pytest.raises(NoCaptions, match="give the tokenizer they were encoded with"):
        train.main(train_args(encoded["dir"], tmp_path / "m", tmp_path / "c", "--steps", "1"))


def test_random_crops_need_image_shards(encoded, models):
    index = index_shards(encoded["dir"])
    plan = RunPlan([{"resolution": RESOLUTION, "batch_size": 2, "learning_rate": 1e-4, "steps": 1}])
    with pytest.raises(ValueError, match="--random-crop needs image shards"):
        StepBatches(index, BatchPlan(index.aspect, plan, 0, 0, 1, 8, True), 1, 1, 0.0, True)



def test_the_identity_is_the_same_in_another_process():
    # the encode job and the training job are two processes: a set's order (diffusers'
    # `_use_default_values`) changes with PYTHONHASHSEED and must not reach the identity
    import subprocess
    import sys
    code = ("from trainer.models.loading import load_models; from trainer.data.latents import models_identity; "
            "print(models_identity(load_models('tiny', None, 0)))")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    identities = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo,
                                 env={**os.environ, "PYTHONHASHSEED": str(seed),  # this checkout's code, as pytest's
                                      "PYTHONPATH": os.pathsep.join([os.path.join(repo, "functions"), repo])}
                                 ).stdout.strip() for seed in (1, 2, 3)}

    assert len(identities) == 1 and len(identities.pop()) == 64


def test_tokenizers_of_one_vocabulary_that_split_text_apart_have_other_states():
    from transformers import T5TokenizerFast
    from trainer.data.latents import tokenizer_state
    pieces = ["<pad>", "</s>", "<unk>", "\u2581", "a", "b", "\u2581a", "\u2581ab", "ab"]
    scored = lambda scores: T5TokenizerFast(vocab=list(zip(pieces, scores)), extra_ids=0)  # noqa: E731
    first, second = scored([0, 0, 0, -3, -3, -3, -2, -1, -2]), scored([0, 0, 0, -3, -3, -3, -1, -9, -1])
    assert first.get_vocab() == second.get_vocab() and first.tokenize("ab") != second.tokenize("ab")
    assert tokenizer_state(first) != tokenizer_state(second)
    before = tokenizer_state(first)
    first(["ab", "a"], padding="max_length", max_length=8, truncation=True)  # a call sets the backend's padding
    assert tokenizer_state(first) == before


def test_the_summary_counts_the_captions_the_clip_tokenizer_cuts(tmp_path, models, samples, write_shard, encoded):
    write_shard(tmp_path / "shards" / "shard.tar", [{**samples[0], "caption": "a red dog " * 30}, *samples[1:3]])
    summary = encode_shards(tmp_path / "shards", tmp_path / "latents", models, RESOLUTION, CPU, batch_size=2, num_workers=0)
    assert (summary["captions_cut"], encoded["captions_cut"]) == ({"tokenizer": 1}, {"tokenizer": 0})
