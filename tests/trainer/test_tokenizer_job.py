"""trainer.jobs.tokenizer: the tokenizers a preset needs, learned from the job's captions and saved as the
pipeline's subfolders; the training job that reads them (--tokenizer), or learns its own, and its report."""

import json
import os
import shutil

import pytest
from transformers import AutoTokenizer, CLIPTokenizer, T5TokenizerFast

from trainer import container
from trainer.jobs import tokenizer as tokenizer_job
from trainer.jobs import train
from trainer.models.loading import read_preset
from trainer.models import text_tokenizers


def learn(shards_dir, model_dir, *extra: str) -> dict:
    return tokenizer_job.main(tokenizer_job.parse_args(["--train-dir", str(shards_dir), "--model-dir", str(model_dir),
                                                        *extra]))


def test_the_job_saves_each_tokenizer_the_preset_needs_as_its_pipeline_subfolder(tmp_path, shards_dir, samples):
    report = learn(shards_dir, tmp_path, "--model-config", "tiny-sd3")

    loaded = {name: AutoTokenizer.from_pretrained(tmp_path, subfolder=name) for name in ("tokenizer", "tokenizer_2",
                                                                                         "tokenizer_3")}
    assert [type(loaded[name]) for name in loaded] == [CLIPTokenizer, CLIPTokenizer, T5TokenizerFast]
    assert loaded["tokenizer"].tokenize(samples[0]["caption"]) == ["a</w>", "red</w>", "dog</w>", "number</w>", "0</w>"]
    assert json.loads((tmp_path / "tokenization.json").read_text()) == report
    assert {name: figures["captions"] for name, figures in report["tokenizers"].items()} == {
        "tokenizer": 6, "tokenizer_2": 6, "tokenizer_3": 6}
    assert report["tokenizers"]["tokenizer"]["cut_share"] == 0.0
    assert "captions cut" not in (tmp_path / "report.html").read_text()  # a tokenizer job's page: its own section
    assert "<h2>Tokenizer</h2>" in (tmp_path / "report.html").read_text()


def test_the_job_never_reads_the_caption_of_an_excluded_sample(tmp_path, shards_dir, samples):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"exclude": {"shard-a": [samples[0]["key"]]}}))

    report = learn(shards_dir, tmp_path / "model", "--manifest", str(manifest))

    assert report["tokenizers"]["tokenizer"]["captions"] == 5


def test_the_container_runs_a_tokenizer_job_into_the_model_dir(tmp_path, monkeypatch, shards_dir):
    root = tmp_path / "opt-ml"
    config = root / "input" / "config"
    config.mkdir(parents=True)
    (config / "hyperparameters.json").write_text(json.dumps({"task": "tokenizer", "model-config": "tiny-pixart"}))
    (config / "inputdataconfig.json").write_text(json.dumps({"train": {"TrainingInputMode": "FastFile"}}))
    shutil.copytree(shards_dir, root / "input" / "data" / "train")
    monkeypatch.setenv("ATELIER_OPT_ML", str(root))
    before = dict(os.environ)
    try:
        assert container.main(["train"]) == 0
    finally:
        os.environ.clear()
        os.environ.update(before)
    assert type(AutoTokenizer.from_pretrained(root / "model", subfolder="tokenizer")) is T5TokenizerFast


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, shards_dir):
    root = tmp_path_factory.mktemp("tokenizer-job")
    learn(shards_dir, root)
    return root


def test_a_training_run_reads_the_tokenizer_channel_and_its_saved_pipeline_gives_the_same_ids(tmp_path, shards_dir,
                                                                                              train_args, job_dir):
    record = train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "c", "--steps", "1",
                                   "--tokenizer", str(job_dir)))

    assert record["tokenizer"]["source"] == "tokenizer channel"
    saved = AutoTokenizer.from_pretrained(tmp_path / "model", subfolder="tokenizer")
    expected = AutoTokenizer.from_pretrained(job_dir, subfolder="tokenizer")
    assert saved("a red dog, unseen words").input_ids == expected("a red dog, unseen words").input_ids


def test_a_run_without_a_tokenizer_learns_the_job_s_from_its_shards_and_reports_the_captions_cut(
        tmp_path, shards_dir, train_args, job_dir):
    record = train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "c", "--steps", "1"))

    assert record["tokenizer"]["source"] == "learned from the training captions"
    assert record["tokenizer"]["tokenizers"]["tokenizer"]["cut_share"] == 0.0
    saved = AutoTokenizer.from_pretrained(tmp_path / "model", subfolder="tokenizer")
    assert saved.get_vocab() == AutoTokenizer.from_pretrained(job_dir, subfolder="tokenizer").get_vocab()
    assert "captions cut at the context length" in (tmp_path / "model" / "report.html").read_text()


def test_a_tokenizer_folder_without_a_tokenizer_the_preset_needs_is_refused(tmp_path, job_dir):
    with pytest.raises(text_tokenizers.TokenizerMissing, match="no tokenizer_2/"):
        text_tokenizers.load(job_dir, read_preset("tiny-sdxl"))
