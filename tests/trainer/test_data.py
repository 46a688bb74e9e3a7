"""trainer.data: shards in, decoded and cropped training samples out."""

import itertools

import pytest
import torch
from PIL import Image

from trainer.data import NoShardsError, find_shards, make_loader, resize_and_crop, to_tensor


def take(loader, count: int) -> list:
    return list(itertools.islice(iter(loader), count))


def test_finds_shards_at_any_depth_in_sorted_order(shards_dir):
    assert find_shards(shards_dir) == [str(shards_dir / "nested" / "shard-b.tar"), str(shards_dir / "shard-a.tar")]


def test_an_empty_channel_is_a_clear_error(tmp_path):
    (tmp_path / "not-a-shard.txt").write_text("x")
    with pytest.raises(NoShardsError, match=f"no shards \\(\\*.tar\\) under the training channel {tmp_path}"):
        find_shards(tmp_path)


def test_batches_hold_pixels_in_range_and_the_matching_captions(shards_dir, samples):
    (batch,) = take(make_loader(shards_dir, resolution=32, batch_size=3, seed=0, num_workers=0), 1)
    assert batch["pixel_values"].shape == (3, 3, 32, 32)
    assert batch["pixel_values"].dtype == torch.float32
    assert batch["pixel_values"].min() >= -1.0 and batch["pixel_values"].max() <= 1.0
    captions = {sample["key"]: sample["caption"] for sample in samples}
    assert batch["caption"] == [captions[key] for key in batch["key"]]
    assert set(batch["shard"]) <= {"shard-a.tar", "shard-b.tar"}


def test_one_pass_reads_every_sample_once_then_the_stream_repeats(shards_dir, samples):
    loader = make_loader(shards_dir, resolution=16, batch_size=1, seed=0, num_workers=0)
    keys = [batch["key"][0] for batch in take(loader, 3 * len(samples))]
    for start in range(0, len(keys), len(samples)):
        assert sorted(keys[start:start + len(samples)]) == sorted(sample["key"] for sample in samples)


def test_the_same_seed_gives_the_same_order_and_another_seed_another(shards_dir):
    def order(seed):
        loader = make_loader(shards_dir, resolution=16, batch_size=1, seed=seed, num_workers=0)
        return [batch["key"][0] for batch in take(loader, 12)]

    assert order(7) == order(7)
    assert order(7) != order(8)


def test_workers_split_the_shards_between_them(shards_dir, samples):
    loader = make_loader(shards_dir, resolution=16, batch_size=1, seed=0, num_workers=2)
    keys = [batch["key"][0] for batch in take(loader, len(samples))]
    assert sorted(keys) == sorted(sample["key"] for sample in samples)


def test_each_local_process_reads_its_own_shards(shards_dir, samples, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    loader = make_loader(shards_dir, resolution=16, batch_size=1, seed=0, num_workers=0)
    # sorted shards: nested/shard-b.tar (rank 0), shard-a.tar (rank 1)
    assert {batch["shard"][0] for batch in take(loader, 9)} == {"shard-a.tar"}


def test_fewer_shards_than_local_processes_is_a_clear_error(shards_dir, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(NoShardsError, match="2 shard\\(s\\) under .* for 3 processes"):
        make_loader(shards_dir, resolution=16, batch_size=1, seed=0, num_workers=0)


def test_a_sample_without_an_image_names_the_sample_and_shard(tmp_path, samples, write_shard):
    sample = {**samples[0], "extension": "gif"}
    write_shard(tmp_path / "bad.tar", [sample])
    with pytest.raises(ValueError, match=f"sample {sample['key']} in bad.tar needs an image"):
        take(make_loader(tmp_path, resolution=16, batch_size=1, seed=0, num_workers=0), 1)


def test_resize_keeps_the_aspect_and_crops_the_centre():
    # GIVEN a 90x30 image, white in the middle 50 columns, black at the sides
    image = Image.new("RGB", (90, 30), "black")
    image.paste(Image.new("RGB", (50, 30), "white"), (20, 0))
    # WHEN it is brought to 15 px (scaled to 45x15, the middle 15 columns kept)
    cropped = resize_and_crop(image, 15)
    # THEN only the white centre is left
    assert cropped.size == (15, 15)
    assert torch.equal(to_tensor(cropped), torch.ones(3, 15, 15))


def test_pixels_map_to_minus_one_and_one():
    image = Image.new("RGB", (2, 1))
    image.putpixel((0, 0), (0, 0, 0))
    image.putpixel((1, 0), (255, 255, 255))
    assert to_tensor(image).tolist() == [[[-1.0, 1.0]]] * 3
