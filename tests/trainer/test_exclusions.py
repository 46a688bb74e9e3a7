"""trainer.data's exclusion list and draw sources, and the draw counts jobs/train.py records."""

import json

import torch

from trainer.data.loader import StepBatches, make_loader
from trainer.data.plan import BatchPlan
from trainer.data.shards import index_shards, load_exclusions, sample_source
from trainer.data.phases import RunPlan


def test_exclusions_come_from_the_manifest_file_or_its_channel_dir(tmp_path):
    manifest = {"bucket": "b", "prefix": "shards/", "shards": [], "exclude": {"shard-a": ["k1", "k2"]}}
    (tmp_path / "atelier-abc.json").write_text(json.dumps(manifest))
    expected = {"shard-a": frozenset({"k1", "k2"})}
    assert load_exclusions(tmp_path / "atelier-abc.json") == expected
    assert load_exclusions(tmp_path) == expected
    assert load_exclusions(None) == {}


def test_a_manifest_from_before_exclusions_excludes_nothing(tmp_path):
    (tmp_path / "m.json").write_text(json.dumps({"bucket": "b", "prefix": "shards/", "shards": []}))
    assert load_exclusions(tmp_path) == {}


def test_excluded_samples_are_never_read_nor_drawn(tmp_path, write_members, encode_image):
    # GIVEN a shard whose sample "bad" is excluded, and whose members would be reported as corrupt if read
    good = [(f"k{n}.png", encode_image((32, 32), "PNG", n)) for n in range(3)]
    members = [m for n, (name, data) in enumerate(good)
               for m in [(name, data), (f"k{n}.txt", b"a cat"), (f"k{n}.json", b'{"partner": "p", "license": "l"}')]]
    members += [("bad.png", b"not a png"), ("bad.txt", b"x"), ("bad.json", b"{not json")]
    write_members(tmp_path / "channel" / "shard-x.tar", members)

    # WHEN the shard is indexed with the exclusion list and batches are drawn
    index = index_shards(tmp_path / "channel", exclude={"shard-x": {"bad"}})
    drawn = {key for batch in make_loader(step_batches_of(index), 0) for key in batch["key"]}

    # THEN "bad" was never indexed, read or drawn (no problem reported), the others were
    assert sorted(index.key) == ["k0", "k1", "k2"]
    assert (index.excluded, index.problems) == (1, [])
    assert drawn == {"k0", "k1", "k2"}


def step_batches_of(index):
    """Six steps of two 32 px images on one process."""
    plan = RunPlan([{"resolution": 32, "batch_size": 2, "learning_rate": 1e-4, "steps": 6}])
    return StepBatches(index, BatchPlan(index.aspect, plan, 0, 0, 1, 8, True), 1, 6, 0.0, False)


def test_each_sample_s_partner_and_license_come_from_its_record(shards_dir):
    batch = step_batches_of(index_shards(shards_dir)).batch(1, 0)
    assert batch["source"] == [("partner-a", "cc-by-4.0")] * 2
    assert sample_source(None) == ("unknown", "unknown")
    assert sample_source(b'{"url": "https://example.com/1.jpg"}') == ("unknown", "unknown")


def test_the_run_records_its_draws_per_partner_and_license(trained):
    # 3 steps of 2 images on one process; the checkpoint at step 2 holds the draws so far
    assert trained["record"]["draws"] == {"partner-a": {"cc-by-4.0": 6}}
    written = json.loads((trained["model_dir"] / "atelier-training.json").read_text())
    assert written["draws"] == trained["record"]["draws"]
    state = torch.load(trained["checkpoint_dir"] / "step-00000002" / "training_state.pt", weights_only=False)
    assert state["draws"] == {"partner-a": {"cc-by-4.0": 4}}
