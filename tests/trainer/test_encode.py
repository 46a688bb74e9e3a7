"""trainer.jobs.encode: latent shards hold exactly what the online path computes, and train to the same loss."""

import io
import json
import os
import shutil
import struct
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from trainer import container
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


def members_of(path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {member.name: tar.extractfile(member).read() for member in tar.getmembers()}


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


@pytest.fixture
def saved_environment():
    """The container exports SM_* into os.environ; the environment comes back as it was."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


def test_the_container_runs_an_encode_job_into_the_checkpoint_directory(tmp_path, monkeypatch, saved_environment, shards_dir,
                                                                        models, encoded):
    # GIVEN a SageMaker job with task=encode and the image shards as its train channel
    root = tmp_path / "opt-ml"
    config = root / "input" / "config"
    config.mkdir(parents=True)
    (config / "hyperparameters.json").write_text(json.dumps({"task": "encode", "model-config": "tiny", "seed": "0",
                                                             "resolution": "32", "num-workers": "0"}))
    (config / "inputdataconfig.json").write_text(json.dumps({"train": {"TrainingInputMode": "FastFile"}}))
    shutil.copytree(shards_dir, root / "input" / "data" / "train")
    monkeypatch.setenv("ATELIER_OPT_ML", str(root))
    # WHEN the image's entrypoint runs `train`
    assert container.main(["train"]) == 0
    # THEN the latent shards are under the checkpoint directory CheckpointConfig uploads, as encode_shards wrote them
    target = root / "checkpoints" / "latents" / f"{models_identity(models)[:16]}-r32"
    assert json.loads((target / "encoding.json").read_text())["samples_encoded"] == 6
    written, expected = members_of(target / "shard-a.tar"), members_of(f"{encoded['dir']}/shard-a.tar")
    assert written.keys() == expected.keys()
    assert all(torch.equal(load_safetensors(written[name])["latent_dist"], load_safetensors(expected[name])["latent_dist"])
               for name in written if name.endswith(".safetensors"))


def test_the_container_s_encode_job_skips_what_its_manifest_channel_excludes(tmp_path, monkeypatch, saved_environment,
                                                                             shards_dir, samples):
    # GIVEN an encode job whose `manifest` channel (the training job's manifest JSON) excludes a sample of shard-b
    revoked = sorted(sample["key"] for sample in samples[3:])[0]
    root = tmp_path / "opt-ml"
    config = root / "input" / "config"
    config.mkdir(parents=True)
    (config / "hyperparameters.json").write_text(json.dumps({"task": "encode", "model-config": "tiny", "seed": "0",
                                                             "resolution": "32", "num-workers": "0"}))
    (config / "inputdataconfig.json").write_text(json.dumps({"train": {"TrainingInputMode": "FastFile"},
                                                             "manifest": {"TrainingInputMode": "File"}}))
    shutil.copytree(shards_dir, root / "input" / "data" / "train")
    (root / "input" / "data" / "manifest").mkdir(parents=True)
    (root / "input" / "data" / "manifest" / "atelier-x.json").write_text(json.dumps(
        {"bucket": "b", "prefix": "shards/", "shards": [], "exclude": {"shard-b": [revoked]}}))
    monkeypatch.setenv("ATELIER_OPT_ML", str(root))

    # WHEN the image's entrypoint runs `train`
    assert container.main(["train"]) == 0

    # THEN the latent twin of shard-b has no member of the excluded sample, and the summary counts it
    [target] = (root / "checkpoints" / "latents").iterdir()
    assert not any(name.startswith(f"{revoked}.") for name in members_of(target / "nested" / "shard-b.tar"))
    summary = json.loads((target / "encoding.json").read_text())
    assert (summary["samples_encoded"], summary["samples_excluded"]) == (5, 1)


def test_the_identity_is_the_same_in_another_process():
    # the encode job and the training job are two processes: a set's order (diffusers'
    # `_use_default_values`) changes with PYTHONHASHSEED and must not reach the identity
    import subprocess
    import sys
    code = ("from trainer.models.loading import load_models; from trainer.data.latents import models_identity; "
            "print(models_identity(load_models('tiny', None, 0)))")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    identities = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo,
                                 env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout.strip() for seed in (1, 2, 3)}

    assert len(identities) == 1 and len(identities.pop()) == 64


def test_one_sample_is_always_written_as_the_same_bytes():
    """safetensors writes its metadata in a hash order that changes per call; the latent file must not."""
    from safetensors.torch import load

    from contracts.shard_members import LATENTS
    from trainer.data.latents import sample_members
    latent_dist = torch.arange(8 * 4 * 4, dtype=torch.float32).reshape(8, 4, 4)
    written = {dict(sample_members("k", latent_dist, [64, 64, 0, 0, 64, 64], torch.tensor([1, 2, 3]), b"{}",
                                   "identity", 64, (64, 64)))[f"k.{LATENTS}"] for _ in range(20)}
    assert len(written) == 1
    data = written.pop()
    assert torch.equal(load(data)["latent_dist"], latent_dist)
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    assert header["__metadata__"] == {"bucket": "64x64", "encoder": "identity", "resolution": "64"}
    assert list(header["__metadata__"]) == ["bucket", "encoder", "resolution"]


def test_padded_calls_take_the_whole_batch_and_give_the_same_latents(tmp_path, shards_dir, models, monkeypatch):
    """A compiled encode (trainer.jobs.encode --compile) pads short groups to the batch size, so each bucket
    shape compiles once; the padding's latents are dropped and the others are the unpadded ones."""
    from safetensors.torch import load as load_safetensors
    shapes, real_encode = [], models.vae.encode

    def recording(pixels, *args, **kwargs):
        shapes.append(tuple(pixels.shape))
        return real_encode(pixels, *args, **kwargs)

    monkeypatch.setattr(models.vae, "encode", recording)
    plain = encode_shards(shards_dir, tmp_path / "plain", models, RESOLUTION, CPU, batch_size=4, num_workers=0)
    plain_shapes, shapes[:] = list(shapes), []
    padded = encode_shards(shards_dir, tmp_path / "padded", models, RESOLUTION, CPU, batch_size=4, num_workers=0, padded=True)

    assert any(shape[0] < 4 for shape in plain_shapes)  # three samples a shard: short groups exist
    assert {shape[0] for shape in shapes} == {4} and padded["padded"] and padded["samples_encoded"] == plain["samples_encoded"]
    for tar in Path(plain["dir"]).rglob("*.tar"):
        ours, theirs = members_of(tar), members_of(Path(padded["dir"]) / tar.relative_to(plain["dir"]))
        assert list(ours) == list(theirs)
        for name in ours:
            if name.endswith(".safetensors"):
                for key, value in load_safetensors(ours[name]).items():
                    torch.testing.assert_close(load_safetensors(theirs[name])[key], value, atol=1e-5, rtol=1e-4)
            else:
                assert ours[name] == theirs[name]


def test_encode_compiles_by_default_on_a_gpu_only():
    from trainer.jobs.encode import parse_args
    assert parse_args(["--train-dir", "x", "--output-dir", "y"]).compile == "auto"
    assert parse_args(["--train-dir", "x", "--output-dir", "y", "--compile", "false"]).compile is False


def test_a_latent_shard_is_a_ustar_tar_with_the_packers_fixed_headers(tmp_path):
    from trainer.jobs.latent_writer import write_tar
    # GIVEN a member name outside ASCII (a PAX tar would give it an extended header of its own)
    name = "clé.ids.npy"
    write_tar(tmp_path / "s.tar", [(name, b"123")])
    header = (tmp_path / "s.tar").read_bytes()[:tarfile.BLOCKSIZE]
    info = tarfile.TarInfo.frombuf(header, "utf-8", "strict")
    # THEN the first block is the member's own ustar header, as core.pack.shards writes one
    assert (header[156:157], header[257:265]) == (tarfile.REGTYPE, b"ustar\x0000")
    assert (info.name, info.size, info.mode, info.mtime, info.uid, info.gid, info.uname) == (name, 3, 0o644, 0, 0, 0, "")


def files_under(folder) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(Path(folder).rglob("*")) if path.is_file()}


def test_an_error_while_writing_a_shard_fails_the_job_and_leaves_only_the_shards_written_before(tmp_path, monkeypatch,
                                                                                               encoded, shards_dir, models):
    # GIVEN a tar writer that fails in the middle of the second shard (three samples, three members each, whose
    # headers are made twice: for the shard's sample table, then for the tar)
    from contracts import shard_members
    headers, real_tarinfo = [], shard_members.tarinfo

    def failing(name, size):
        headers.append(name)
        if len(headers) == 2 * 9 + 9 + 2:
            raise OSError("disk full")
        return real_tarinfo(name, size)

    monkeypatch.setattr(shard_members, "tarinfo", failing)
    # WHEN the shards are encoded
    with pytest.raises(OSError, match="disk full"):
        encode_shards(shards_dir, tmp_path, models, RESOLUTION, CPU, batch_size=2, num_workers=0)
    # THEN the first shard (nested/shard-b.tar, in sorted order) is there whole with its table, and nothing of the
    # second, not even its temporary file or its table
    written = files_under(latent_dir(tmp_path, models_identity(models), RESOLUTION))
    assert written == {name: data for name, data in files_under(encoded["dir"]).items() if "shard-b" in name}
    assert sorted(written) == ["indexes/shard-b.table", "nested/shard-b.tar"]


def test_the_shards_are_the_same_bytes_however_slow_the_writer_and_wherever_captions_are_tokenized(tmp_path, monkeypatch,
                                                                                                   encoded, shards_dir,
                                                                                                   models):
    # GIVEN a writer thread slower than the VAE, and loader workers that tokenize the captions
    from trainer.jobs import latent_writer
    real_sample_members = latent_writer.sample_members

    def slow(*args):
        time.sleep(0.05)
        return real_sample_members(*args)

    monkeypatch.setattr(latent_writer, "sample_members", slow)
    # WHEN the shards are encoded
    result = encode_shards(shards_dir, tmp_path, models, RESOLUTION, CPU, batch_size=2, num_workers=2)
    # THEN every file is byte for byte what the unhurried single-process encode wrote
    assert files_under(result["dir"]) == files_under(encoded["dir"])
    assert result["samples_encoded"] == encoded["samples_encoded"] == 6


def test_the_main_thread_waits_for_the_writer_rather_than_queueing_more_than_depth_groups(tmp_path, monkeypatch):
    # GIVEN a writer of depth 2 whose thread is busy with a first group until released
    from trainer.jobs import latent_writer
    running, release = threading.Event(), threading.Event()
    monkeypatch.setattr(latent_writer, "sample_members", lambda *args: running.set() or release.wait(timeout=60) or [])
    group = {"rows": [0], "time_ids": [[32, 32, 0, 0, 32, 32]], "ids": torch.zeros(1, 1, 77, dtype=torch.int64),
             "records": [None], "bucket": (32, 32)}
    handed = []

    def hand_over(writer, count):
        for number in range(count):
            writer.add(0, ["k"], group, torch.zeros(1, 8, 4, 4), None)
            handed.append(number)

    with latent_writer.ShardWriter({0: tmp_path / "s.tar"}, "identity", RESOLUTION, tmp_path / "indexes", depth=2) as writer:
        try:
            hand_over(writer, 1)
            assert running.wait(timeout=60)
            # WHEN the main thread hands over four more groups
            feeder = threading.Thread(target=hand_over, args=(writer, 4), daemon=True)
            feeder.start()
            feeder.join(timeout=1)
            # THEN two wait in the queue and the third waits for room
            assert feeder.is_alive() and len(handed) == 3
        finally:
            release.set()
        feeder.join(timeout=60)
    assert len(handed) == 5


def test_the_summary_says_how_long_the_main_thread_waited_on_the_loader_and_on_the_writer(shards_dir, tmp_path, models,
                                                                                            monkeypatch):
    # GIVEN a loader whose every group takes 0.2 s to read (the workers are what bounds this encode)
    from trainer.jobs import encode
    read = encode.ImageGroups.__getitem__

    def slowly(self, item):
        time.sleep(0.2)
        return read(self, item)

    monkeypatch.setattr(encode.ImageGroups, "__getitem__", slowly)
    # WHEN the shards are encoded two samples a call (three samples a shard: four groups)
    summary = encode_shards(shards_dir, tmp_path / "out", models, RESOLUTION, CPU, batch_size=2, num_workers=0)
    # THEN the summary puts the wait on the loader, not on the writer
    assert summary["loader_wait_s"] >= 4 * 0.2
    assert summary["writer_wait_s"] < 0.2 <= summary["loader_wait_s"] <= summary["seconds"]
