"""trainer.data (shards, plan, loader, images, buckets, phases): shards in, deterministic bucketed batches out."""

import itertools
import json
import tarfile

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from trainer.data.buckets import assign_buckets, bucket_sizes, cover_and_crop
from trainer.data.images import to_tensor
from trainer.data.loader import StepBatches, make_loader
from trainer.data.plan import BatchPlan
from trainer.data.shards import NoShardsError, find_shards, index_shards
from trainer.data.phases import RunPlan, plan_from_args, read_run_config

BUCKETS_32 = [(24, 40), (32, 32), (40, 24)]  # at 32 px with a size multiple of 8


def step_batches(channel, steps=6, batch_size=2, resolution=32, seed=0, rank=0, buckets=True, dropout=0.0,
                 random_crop=False, accumulation=1, local=(0, 1)):
    index = index_shards(channel, *local)
    plan = RunPlan([{"resolution": resolution, "batch_size": batch_size, "learning_rate": 1e-4, "steps": steps}])
    batch_plan = BatchPlan(index.aspect, plan, seed, rank, accumulation, 8, buckets)
    return StepBatches(index, batch_plan, 1, steps, dropout, random_crop)


def keys_of(dataset) -> list[list[str]]:
    return [batch["key"] for batch in make_loader(dataset, 0)]


# ---------------------------------------------------------------- index


def test_finds_shards_at_any_depth_in_sorted_order(shards_dir):
    assert find_shards(shards_dir) == [str(shards_dir / "nested" / "shard-b.tar"), str(shards_dir / "shard-a.tar")]


def test_dot_names_are_not_shards_as_in_the_s3_manifest(tmp_path):
    # GIVEN a channel holding a finished shard, a half-written one a stopped encode job left, and a hidden folder
    for name in ("shard-a.tar", ".tmp-shard-b.tar", ".cache/shard-c.tar"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    # THEN only the finished shard is read, though the channel itself may sit under a dot folder
    assert find_shards(tmp_path) == [str(tmp_path / "shard-a.tar")]
    hidden_root = tmp_path / ".cache"
    assert find_shards(hidden_root) == [str(hidden_root / "shard-c.tar")]


def test_an_empty_channel_is_a_clear_error(tmp_path):
    (tmp_path / "not-a-shard.txt").write_text("x")
    with pytest.raises(NoShardsError, match=f"no shards \\(\\*.tar\\) under the training channel {tmp_path}"):
        find_shards(tmp_path)


def test_the_index_holds_every_sample_with_its_aspect_from_the_metadata(shards_dir, samples):
    index = index_shards(shards_dir)
    assert sorted(index.key) == sorted(sample["key"] for sample in samples)
    aspects = dict(zip(index.key, index.aspect))
    assert {key: aspects[sample["key"]] for sample in samples for key in [sample["key"]]} == {
        sample["key"]: sample["metadata"]["width"] / sample["metadata"]["height"] for sample in samples
    }
    assert index.problems == []


def test_the_index_reads_the_same_samples_as_webdataset(shards_dir):
    # GIVEN webdataset's own reading of the shards, as the reference
    expected = {sample["__key__"]: sample["txt"] for sample in wds.WebDataset(find_shards(shards_dir), shardshuffle=False)}
    # WHEN every sample of the index is read through wids
    dataset = step_batches(shards_dir)
    index = dataset.index
    captions = {str(index.key[row]): dataset.read(row)["txt"] for row in range(len(index))}
    # THEN the same keys and caption bytes
    assert captions == expected


def test_without_width_and_height_the_aspect_comes_from_the_image_header(tmp_path, write_members, encode_image):
    write_members(tmp_path / "s.tar", [("k.png", encode_image((30, 10), "PNG", 1)), ("k.txt", b"a cat"),
                                       ("k.json", json.dumps({"partner": "p"}).encode())])
    assert index_shards(tmp_path).aspect.tolist() == [3.0]


def test_an_aspect_bucket_field_from_ingest_is_used_when_present(tmp_path, write_members, encode_image):
    record = {"width": 30, "height": 10, "aspect_bucket": "1:2"}  # contracts.aspect_buckets' name of 1/2
    write_members(tmp_path / "s.tar", [("k.png", encode_image((30, 10), "PNG", 1)), ("k.txt", b"a cat"),
                                       ("k.json", json.dumps(record).encode())])
    assert index_shards(tmp_path).aspect.tolist() == [0.5]


def test_shards_are_split_between_the_processes_of_a_host(shards_dir):
    # sorted shards: nested/shard-b.tar (local rank 0), shard-a.tar (local rank 1)
    assert index_shards(shards_dir, 1, 2).shards == [str(shards_dir / "shard-a.tar")]
    assert index_shards(shards_dir, 0, 2).shards == [str(shards_dir / "nested" / "shard-b.tar")]


def test_with_fewer_shards_than_processes_the_samples_are_split(shards_dir, samples):
    parts = [set(index_shards(shards_dir, rank, 3).key) for rank in range(3)]
    assert [len(part) for part in parts] == [2, 2, 2]
    assert set().union(*parts) == {sample["key"] for sample in samples}


# ---------------------------------------------------------------- batches


def test_batches_hold_pixels_in_range_and_the_matching_captions(shards_dir, samples):
    batch = step_batches(shards_dir, batch_size=2).batch(1, 0)
    assert batch["pixel_values"].dtype == torch.float32
    assert tuple(batch["pixel_values"].shape[2:][::-1]) in BUCKETS_32
    assert batch["pixel_values"].min() >= -1.0 and batch["pixel_values"].max() <= 1.0
    captions = {sample["key"]: sample["caption"] for sample in samples}
    assert batch["caption"] == [captions[key] for key in batch["key"]]
    assert set(batch["shard"]) <= {"shard-a.tar", "shard-b.tar"}


def test_a_batch_is_a_pure_function_of_seed_step_and_rank(shards_dir):
    first = keys_of(step_batches(shards_dir, steps=9))
    assert keys_of(step_batches(shards_dir, steps=9)) == first
    # a resumed job starting at step 5 reads what the uninterrupted one read from step 5 on
    resumed = step_batches(shards_dir, steps=9)
    resumed.first_step = 5
    assert keys_of(resumed) == first[4:]
    assert keys_of(step_batches(shards_dir, steps=9, rank=1)) != first
    assert keys_of(step_batches(shards_dir, steps=9, seed=1)) != first


def test_with_keys_the_batches_do_not_depend_on_how_the_samples_were_packed():
    # GIVEN the same 40 samples in two layouts (which shard, and where, follows the uploads' arrival)
    keys, aspects = np.array([f"{n:064x}" for n in range(40)]), np.ones(40)
    plan = RunPlan([{"resolution": 32, "batch_size": 4, "learning_rate": 1e-4, "steps": 10}])
    layout = np.random.default_rng(3).permutation(40)

    def batches(rows: np.ndarray, **keyed) -> np.ndarray:
        return keys[rows][BatchPlan(aspects[rows], plan, 0, 0, 1, 8, False, **keyed).epoch_batches(0, 0)[0]]

    # THEN with the keys both draw the same samples in the same batches; without them, not
    assert (batches(np.arange(40), keys=keys) == batches(layout, keys=keys[layout])).all()
    assert not (batches(np.arange(40)) == batches(layout)).all()


def test_loader_workers_split_the_batches_and_keep_the_step_order(shards_dir):
    dataset = step_batches(shards_dir, steps=6)
    with_workers = [batch["key"] for batch in make_loader(dataset, 2)]
    assert with_workers == keys_of(dataset)


def test_each_epoch_reads_every_sample_once(shards_dir, samples):
    # 6 samples, 2 per bucket, batches of 2: 3 batches an epoch
    keys = keys_of(step_batches(shards_dir, steps=9))
    for epoch in range(3):
        assert sorted(itertools.chain(*keys[3 * epoch:3 * epoch + 3])) == sorted(sample["key"] for sample in samples)


def test_bucketed_batches_hold_one_shape_cropped_from_images_of_that_aspect(shards_dir, samples):
    # GIVEN images of 80x48 (wide), 40x72 (tall) and 64x64, in batches of 2 at 32 px
    sizes = {sample["key"]: sample["metadata"] for sample in samples}
    for batch in make_loader(step_batches(shards_dir, steps=6), 0):
        height, width = batch["pixel_values"].shape[2:]
        # THEN each batch has one bucket's shape, the one nearest its images' aspect ratio
        assert (width, height) in BUCKETS_32
        for key, time_ids in zip(batch["key"], batch["time_ids"].tolist()):
            source = sizes[key]
            expected = BUCKETS_32[assign_buckets(np.array([source["width"] / source["height"]]), BUCKETS_32)[0]]
            assert (width, height) == expected
            # and the SDXL ids name the original size, the centred crop and the target size
            (resized_w, resized_h), (left, top) = cover_and_crop(source["width"], source["height"], expected, (0.5, 0.5))
            assert time_ids == [source["height"], source["width"], top, left, height, width]


def test_without_buckets_every_batch_is_a_centred_square(shards_dir):
    for batch in make_loader(step_batches(shards_dir, steps=3, buckets=False), 0):
        assert batch["pixel_values"].shape == (2, 3, 32, 32)


def test_caption_dropout_empties_that_share_of_captions(shards_dir):
    captions = [caption for batch in make_loader(step_batches(shards_dir, steps=30, dropout=0.5), 0) for caption in batch["caption"]]
    assert 15 <= captions.count("") <= 45


def test_a_corrupt_member_is_skipped_counted_and_replaced(tmp_path, samples, write_shard):
    # GIVEN a shard whose one sample's JPEG bytes are garbage, beside good samples of the same shape
    bad = {**samples[0], "image": b"\xff\xd8\xff\xe0 not really a jpeg"}
    good = [make for make in samples if make["extension"] == "jpg" and make is not samples[0]]
    write_shard(tmp_path / "shard.tar", [bad, *good])
    # WHEN batches are drawn for a few epochs
    dataset = step_batches(tmp_path, steps=4, batch_size=1, buckets=False)
    batches = list(make_loader(dataset, 0))
    # THEN the bad sample never reaches a batch, each time it was drawn it is reported, nothing raises
    assert all(bad["key"] not in batch["key"] for batch in batches)
    reports = [report for batch in batches for report in batch["corrupt"]]
    assert reports and all(report.startswith(f"shard.tar/{bad['key']}: ") for report in reports)
    assert len(batches) == 4 and all(len(batch["key"]) == 1 for batch in batches)


def test_samples_without_an_image_or_caption_are_left_out_of_the_index_and_reported(tmp_path, samples, write_shard):
    gif = {**samples[0], "extension": "gif"}
    write_shard(tmp_path / "bad.tar", [gif, samples[1]])
    index = index_shards(tmp_path)
    assert list(index.key) == [samples[1]["key"]]
    assert index.problems == [f"bad.tar/{gif['key']}: needs an image (jpg/png/webp) and a txt member; has ['gif', 'json', 'txt']"]


def member_offsets(path) -> dict[str, tuple[int, int]]:
    """Member name -> (header offset, data offset) in a tar."""
    with tarfile.open(path) as tar:
        return {info.name: (info.offset, info.offset_data) for info in tar.getmembers()}


def test_a_shard_cut_off_midway_keeps_its_complete_samples(tmp_path, samples, write_shard):
    write_shard(tmp_path / "cut.tar", samples[:3])
    data = (tmp_path / "cut.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: len(data) // 2])
    index = index_shards(tmp_path)
    assert 0 < len(index) < 3
    assert index.problems


def test_a_shard_cut_inside_a_member_keeps_the_samples_before_it(tmp_path, samples, write_shard):
    # GIVEN a shard that ends halfway through the image of its last sample
    write_shard(tmp_path / "cut.tar", samples[:3])
    first, second, last = sorted(samples[:3], key=lambda sample: sample["key"])
    image = f"{last['key']}.{last['extension']}"
    data_offset = member_offsets(tmp_path / "cut.tar")[image][1]
    data = (tmp_path / "cut.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: data_offset + len(last["image"]) // 2])
    # WHEN it is indexed
    index = index_shards(tmp_path)
    # THEN the two complete samples are kept and the cut one is reported
    assert list(index.key) == [first["key"], second["key"]]
    assert index.problems == [f"cut.tar/{image}: cut off (the shard ends inside it)"]


def test_a_shard_cut_inside_a_tar_header_is_left_out_whole_and_reported(tmp_path, samples, write_shard):
    # GIVEN a good shard, and one that ends 100 bytes into the header of its second sample's first member:
    # wids indexes all of a shard or none of it, and it cannot walk past a torn header
    write_shard(tmp_path / "good.tar", samples[3:])
    write_shard(tmp_path / "cut.tar", samples[:3])
    second = sorted(samples[:3], key=lambda sample: sample["key"])[1]
    header_offset = member_offsets(tmp_path / "cut.tar")[f"{second['key']}.{second['extension']}"][0]
    data = (tmp_path / "cut.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: header_offset + 100])
    # WHEN the channel is indexed
    index = index_shards(tmp_path)
    # THEN the good shard's samples are all there and the cut shard is one reported problem
    assert sorted(index.key) == sorted(sample["key"] for sample in samples[3:])
    assert len(index.problems) == 1 and index.problems[0].startswith("cut.tar: wids cannot index it (")


def test_a_shard_with_a_repeated_member_name_is_left_out_and_reported(tmp_path, write_members, encode_image):
    # GIVEN a shard where a.jpg appears twice (wids would pair the second copy with b's members)
    image = encode_image((16, 16), "JPEG", 1)
    write_members(tmp_path / "dup.tar", [("a.jpg", image), ("a.txt", b"a cat"), ("a.jpg", image),
                                         ("b.jpg", image), ("b.txt", b"a dog")])
    write_members(tmp_path / "good.tar", [("c.jpg", image), ("c.txt", b"a cow")])
    # WHEN the channel is indexed
    index = index_shards(tmp_path)
    # THEN only the good shard's sample is there, and the shard with the repeated name is reported
    assert list(index.key) == ["c"]
    assert index.problems == ["dup.tar: repeated member names, which wids would pair with the wrong members"]


def test_reading_writes_nothing_into_the_channel(tmp_path, samples, write_shard):
    # GIVEN a channel (FastFile mounts it read-only)
    write_shard(tmp_path / "shard.tar", samples)
    before = sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*"))
    # WHEN batches are read, in this process and in loader workers
    dataset = step_batches(tmp_path, steps=4)
    list(make_loader(dataset, 0)), list(make_loader(dataset, 2))
    # THEN no index, lock or cache file appeared beside the shard
    assert sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*")) == before


def test_img2dataset_shards_read_unchanged(img2dataset_dir):
    index = index_shards(img2dataset_dir)
    assert sorted(index.key) == ["000000000", "000000001", "000000002", "000010000", "000010001", "000010002"]
    assert sorted(set(index.aspect.tolist())) == [1.0, 1.5]
    batch = step_batches(img2dataset_dir, batch_size=3).batch(1, 0)
    assert all(caption.startswith("a green tree ") for caption in batch["caption"])
    assert batch["corrupt"] == []


def test_pixels_map_to_minus_one_and_one():
    image = Image.new("RGB", (2, 1))
    image.putpixel((0, 0), (0, 0, 0))
    image.putpixel((1, 0), (255, 255, 255))
    assert to_tensor(image).tolist() == [[[-1.0, 1.0]]] * 3


# ---------------------------------------------------------------- buckets and phases


def test_buckets_keep_the_area_and_the_size_multiple():
    sizes = bucket_sizes(256, 64)
    assert (256, 256) in sizes and (192, 320) in sizes and (320, 192) in sizes
    assert all(w % 64 == 0 and h % 64 == 0 and w * h <= 256 * 256 and 0.5 <= w / h <= 2 for w, h in sizes)
    assert bucket_sizes(32, 8) == BUCKETS_32


def test_cover_and_crop_fills_the_bucket_without_stretching():
    # a 90x30 image into a 15x15 bucket: scaled to 45x15, the middle 15 columns kept
    assert cover_and_crop(90, 30, (15, 15), (0.5, 0.5)) == ((45, 15), (15, 0))
    assert cover_and_crop(90, 30, (15, 15), (0.0, 0.0)) == ((45, 15), (0, 0))


def test_phases_follow_each_other_with_their_own_learning_rate_and_warmup():
    plan = RunPlan([{"resolution": 32, "batch_size": 4, "learning_rate": 1e-3, "steps": 3, "warmup_steps": 2},
                    {"resolution": 64, "batch_size": 2, "learning_rate": 1e-4, "steps": 2}])
    assert plan.total_steps == 5
    assert [plan.phase_index(step) for step in range(1, 7)] == [0, 0, 0, 1, 1, 1]
    assert [plan.learning_rate(step) for step in range(1, 6)] == [5e-4, 1e-3, 1e-3, 1e-4, 1e-4]


def test_a_phase_run_as_its_own_job_warms_up_from_its_own_first_step_as_inside_a_run_config():
    # GIVEN two phases, each warming up over 2 steps, the second then a cosine down to half its rate
    phases = [{"resolution": 32, "batch_size": 4, "learning_rate": 1e-3, "steps": 3, "warmup_steps": 2},
              {"resolution": 64, "batch_size": 2, "learning_rate": 1e-4, "steps": 4, "warmup_steps": 2,
               "final_lr_fraction": 0.5}]
    one_job = RunPlan(phases)
    # WHEN the second runs as a job of its own, as the pipeline runs each run-plan job: steps 4..7 of the lineage
    second_job = plan_from_args(None, 7, 2, 64, 1e-4, 2, 32, 0.5, first_step=4)
    # THEN its rates are the run config's second phase's: warm-up from its first step, then the cosine
    rates = [second_job.learning_rate(step) for step in range(4, 8)]
    assert rates == [one_job.learning_rate(step) for step in range(4, 8)]
    assert rates == pytest.approx([5e-5, 1e-4, 7.5e-5, 5e-5])
    assert (second_job.phases[0].first_step, second_job.phases[0].steps, second_job.total_steps) == (4, 4, 7)


def test_a_plan_starting_later_needs_the_checkpoint_of_the_step_before_it():
    plan = plan_from_args(None, 7, 2, 64, 1e-4, 2, 32, first_step=4)
    assert (plan.check_resumed(3), plan.check_resumed(5)) == (3, 5)  # the run-plan job before it ended, or a retry
    with pytest.raises(ValueError, match="starts at step 4 .* resumes at step 0: it needs the checkpoint of step 3"):
        plan.check_resumed(0)


def test_a_run_config_and_single_phase_arguments_do_not_mix():
    with pytest.raises(ValueError, match="run-config 'tiny-progressive' sets the phases; drop steps, batch-size"):
        plan_from_args("tiny-progressive", 10, 2, None, None, 0, 64)


def test_a_run_config_written_with_the_older_key_stages_is_read_as_its_phases(tmp_path):
    # GIVEN a user's run config from before phases had their name, and one that sets both keys
    phases = [{"resolution": 32, "batch_size": 2, "learning_rate": 1e-3, "steps": 2},
              {"resolution": 64, "batch_size": 1, "learning_rate": 5e-4, "steps": 1}]
    older, both = tmp_path / "older.json", tmp_path / "both.json"
    older.write_text(json.dumps({"description": "mine", "stages": phases}))
    both.write_text(json.dumps({"stages": phases, "phases": phases}))
    # WHEN the trainer reads them THEN the older key is read as "phases", and both at once are refused
    plan = plan_from_args(str(older), None, None, None, None, 0, 64)
    assert [(p.first_step, p.resolution, p.batch_size) for p in plan.phases] == [(1, 32, 2), (3, 64, 1)]
    assert read_run_config(str(older)) == {"description": "mine", "phases": phases}
    with pytest.raises(ValueError, match="sets 'phases' or its older name 'stages', not both"):
        read_run_config(str(both))


def test_run_presets_are_read_by_name():
    plan = plan_from_args("tiny-progressive", None, None, None, None, 0, 64)
    assert [phase.resolution for phase in plan.phases] == [32, 64]
    with pytest.raises(ValueError, match="unknown run config 'nope'; presets: sd2-progressive, sdxl-progressive, tiny-progressive"):
        plan_from_args("nope", None, None, None, None, 0, 64)
