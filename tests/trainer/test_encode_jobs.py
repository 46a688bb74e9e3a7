"""trainer.jobs.encode as a job: run by the container, written as the same bytes every time (padded or not,
however slow its writer thread), as ustar tars, with nothing left behind by a failure (the latent shards'
contents and training on them: tests/trainer/test_encode.py)."""

import json
import os
import shutil
import tarfile
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

from trainer import container
from trainer.data.captions import read_captions
from trainer.data.latents import latent_dir, models_identity
from trainer.jobs.encode import encode_shards
from trainer.models.loading import load_models

from tests.trainer.encode_helpers import files_under, members_of

CPU = torch.device("cpu")
RESOLUTION = 32


@pytest.fixture(scope="module")
def models(shards_dir):
    """The tiny preset (seed 0) with tokenizers learned from the shards' captions, as a job without --tokenizer learns them."""
    return load_models("tiny", None, seed=0, captions=lambda: read_captions(shards_dir))


@pytest.fixture(scope="module")
def encoded(tmp_path_factory, shards_dir, models) -> dict:
    """The conftest image shards encoded at 32 px by the tiny model (seed 0)."""
    root = tmp_path_factory.mktemp("latents")
    return encode_shards(shards_dir, root, models, RESOLUTION, CPU, batch_size=2, num_workers=0)


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
