"""trainer.jobs.evaluate: validation loss and CLIP score of a candidate (and baseline) on held-out shards."""

import hashlib
import json
import math
import os
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

from trainer import container
from trainer.data import eval_set
from trainer.jobs import evaluate, scoring
from trainer.models.loading import load_models
from trainer.models.tokenizer import learn_clip

FAST = ["--timesteps", "100,500,900", "--max-samples", "4", "--steps", "2", "--guidance", "3"]


@pytest.fixture(scope="session")
def eval_dir(shards_dir) -> Path:
    """Held-out shards: the shared tiny shards (shard-a.tar, nested/shard-b.tar; six samples), read-only."""
    return shards_dir


@pytest.fixture(scope="module")
def damaged_model(tmp_path_factory, trained) -> Path:
    """The trained pipeline with every UNet weight scaled by 10."""
    root = tmp_path_factory.mktemp("damaged") / "model"
    shutil.copytree(trained["model_dir"], root)
    unet = UNet2DConditionModel.from_pretrained(root, subfolder="unet")
    with torch.no_grad():
        for parameter in unet.parameters():
            parameter.mul_(10)
    unet.save_pretrained(root / "unet")
    return root


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> Path:
    """A tiny random CLIPModel with trainer/models/tokenizer.py's tokenizer and a 32 px image processor, saved."""
    root = tmp_path_factory.mktemp("channel-clip")
    tokenizer = learn_clip(["a red circle on a blue background", "a green square on a white background"] * 2)
    layers = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 2}
    text = {**layers, "vocab_size": len(tokenizer), "max_position_embeddings": 77, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    torch.manual_seed(0)
    CLIPModel(CLIPConfig(text_config=text, vision_config={**layers, "image_size": 32, "patch_size": 8},
                         projection_dim=16)).save_pretrained(root)
    tokenizer.save_pretrained(root)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(root)
    return root


def run(output: Path, candidate: Path, eval_dir: Path, *extra: str) -> dict:
    evaluation = evaluate.main(evaluate.parse_args(
        ["--candidate-dir", str(candidate), "--eval-dir", str(eval_dir), "--model-dir", str(output), *FAST, *extra]))
    assert json.loads((output / "evaluation.json").read_text()) == evaluation
    return evaluation


@pytest.fixture(scope="module")
def plain(tmp_path_factory, trained, eval_dir) -> dict:
    """The trained model's evaluation without a baseline or a scorer."""
    return run(tmp_path_factory.mktemp("plain"), trained["model_dir"], eval_dir)


@pytest.fixture(scope="module")
def full_args(tmp_path_factory, damaged_model, clip_dir) -> list[str]:
    """The damaged model as the baseline, the CLIP scorer as a model.tar.gz channel."""
    clip_channel = tar_gz(clip_dir, tmp_path_factory.mktemp("clip-tar") / "channel-clip")
    return ["--baseline-dir", str(damaged_model), "--clip-dir", str(clip_channel)]


@pytest.fixture(scope="module")
def full(tmp_path_factory, trained, eval_dir, full_args) -> dict:
    """The trained model's evaluation against the damaged one as the baseline, with the CLIP scorer."""
    return run(tmp_path_factory.mktemp("full"), trained["model_dir"], eval_dir, *full_args)


def tar_gz(model_dir: Path, channel: Path) -> Path:
    """A channel as SageMaker fills it from a training job's S3 model.tar.gz: that one file."""
    channel.mkdir(parents=True)
    with tarfile.open(channel / "model.tar.gz", "w:gz") as archive:
        for path in sorted(model_dir.rglob("*")):
            archive.add(path, arcname=path.relative_to(model_dir).as_posix(), recursive=False)
    return channel


# ---------------------------------------------------------------- evaluation.json


def test_the_same_evaluation_twice_gives_identical_numbers(tmp_path, trained, eval_dir, full_args, full):
    assert run(tmp_path, trained["model_dir"], eval_dir, *full_args) == full


def test_evaluation_json_has_the_contracted_shape(plain):
    assert plain["schema"] == 1
    assert plain["config"] == {"timesteps": [100, 500, 900], "seed": 0, "resolution": 32, "steps": 2, "guidance": 3.0}
    assert plain["eval_set"]["samples"] == 4
    assert plain["eval_set"]["shards"] == ["nested/shard-b.tar", "shard-a.tar"]
    candidate = plain["models"]["candidate"]
    assert set(candidate) == {"val_loss", "val_loss_by_timestep", "val_loss_note", "val_loss_measure", "clip_score", "clip_note"}
    assert list(candidate["val_loss_by_timestep"]) == ["100", "500", "900"]
    assert math.isclose(candidate["val_loss"], sum(candidate["val_loss_by_timestep"].values()) / 3, rel_tol=1e-9)
    assert candidate["val_loss_note"] == "mean squared error of the epsilon prediction over 4 samples x 3 timesteps"
    assert candidate["val_loss_measure"] == "epsilon at timesteps 100,500,900"


def test_without_a_baseline_or_a_scorer_there_is_only_the_candidate_and_no_clip_score(plain):
    assert list(plain["models"]) == ["candidate"]
    candidate = plain["models"]["candidate"]
    assert (candidate["clip_score"], candidate["clip_note"]) == (None, "no scorer")


def test_the_eval_set_digest_covers_every_shard_by_name_and_bytes(plain, eval_dir):
    lines = sorted(f"{path.relative_to(eval_dir).as_posix()}\t{hashlib.sha256(path.read_bytes()).hexdigest()}\n"
                   for path in eval_dir.rglob("*.tar"))
    assert plain["eval_set"]["digest"] == hashlib.sha256("".join(lines).encode()).hexdigest()


def test_a_damaged_model_scores_a_higher_val_loss_than_the_trained_one(full):
    original, damaged = full["models"]["candidate"], full["models"]["baseline"]
    assert damaged["val_loss"] > 2 * original["val_loss"]
    for timestep in ("100", "500", "900"):
        assert damaged["val_loss_by_timestep"][timestep] > original["val_loss_by_timestep"][timestep]


def test_a_model_tar_gz_channel_scores_like_the_directory(tmp_path, trained, eval_dir, plain):
    channel = tar_gz(trained["model_dir"], tmp_path / "channel-candidate")
    assert run(tmp_path / "out", channel, eval_dir) == plain


def test_the_clip_score_comes_from_the_clip_channel(full):
    for model in ("candidate", "baseline"):
        assert 0 <= full["models"][model]["clip_score"] <= 100
        assert full["models"][model]["clip_note"] == "mean over 4 captions of 100 * max(cos, 0); 2 DDIM steps, guidance 3"


def test_a_non_finite_loss_is_null_with_a_note():
    config = scoring.EvalConfig([100, 500], seed=0, resolution=32, steps=2, guidance=5.0)
    losses = torch.tensor([[0.5, float("nan")], [0.25, 1.0]], dtype=torch.float64)
    assert scoring.loss_summary(losses, config, "epsilon") == {
        "val_loss": None,
        "val_loss_by_timestep": {"100": 0.375, "500": None},
        "val_loss_note": "non-finite loss at timesteps 500; written as null",
        "val_loss_measure": "epsilon at timesteps 100,500",
    }


# ---------------------------------------------------------------- as a SageMaker training job


@pytest.fixture
def saved_environment():
    """The container exports SM_* into os.environ; each test gets the environment back as it was."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


def evaluation_job(root: Path, hyperparameters: dict, channels: dict[str, Path | None]) -> Path:
    """A SageMaker /opt/ml for an evaluation job: config files and the channels (None: an empty one)."""
    config = root / "input" / "config"
    config.mkdir(parents=True)
    (config / "hyperparameters.json").write_text(json.dumps(hyperparameters))
    (config / "inputdataconfig.json").write_text(json.dumps({name: {"TrainingInputMode": "File"} for name in channels}))
    (config / "resourceconfig.json").write_text(json.dumps({"current_host": "algo-1", "hosts": ["algo-1"]}))
    for name, source in channels.items():
        target = root / "input" / "data" / name
        if source is None:
            target.mkdir(parents=True)
        else:
            shutil.copytree(source, target)
    return root


HYPERPARAMETERS = {"task": "evaluate", "timesteps": "100,900", "max_samples": "2", "steps": "1", "seed": "3"}


def test_the_container_runs_an_evaluation_job_when_task_is_evaluate(tmp_path, monkeypatch, saved_environment,
                                                                    trained, eval_dir):
    # GIVEN an evaluation job whose candidate is a training job's model.tar.gz
    channel = tar_gz(trained["model_dir"], tmp_path / "candidate")
    root = evaluation_job(tmp_path / "opt-ml", HYPERPARAMETERS, {"candidate": channel, "eval": eval_dir})
    monkeypatch.setenv("ATELIER_OPT_ML", str(root))
    # WHEN the image's entrypoint runs `train`
    assert container.main(["train"]) == 0
    # THEN evaluation.json is in the model dir SageMaker uploads
    evaluation = json.loads((root / "model" / "evaluation.json").read_text())
    assert evaluation["config"] == {"timesteps": [100, 900], "seed": 3, "resolution": 32, "steps": 1, "guidance": 5.0}
    assert (evaluation["eval_set"]["samples"], list(evaluation["models"])) == (2, ["candidate"])
    assert not (root / "output" / "failure").exists()


@pytest.mark.parametrize(
    ("hyperparameters", "channels", "reason"),
    [
        (HYPERPARAMETERS, {"candidate": "model"}, "EvaluationError: the evaluation needs an `eval` channel of held-out shards"),
        (HYPERPARAMETERS, {"candidate": "model", "eval": None}, "EvaluationError: no shards (*.tar) under the eval channel"),
        (HYPERPARAMETERS, {"eval": "eval"}, "EvaluationError: the evaluation needs a `candidate` channel"),
        (HYPERPARAMETERS, {"candidate": None, "eval": "eval"},
         "EvaluationError: the candidate channel"),
        ({**HYPERPARAMETERS, "batch-size": "4"}, {"candidate": "model", "eval": "eval"},
         "unrecognized arguments: --batch-size 4"),
        ({**HYPERPARAMETERS, "task": "distil"}, {}, "ValueError: unknown task 'distil': the hyperparameter `task` is one of"),
    ],
)
def test_an_evaluation_job_that_cannot_run_fails_with_the_reason(tmp_path, monkeypatch, saved_environment, trained,
                                                                 eval_dir, hyperparameters, channels, reason):
    sources = {"model": trained["model_dir"], "eval": eval_dir, None: None}
    root = evaluation_job(tmp_path / "opt-ml", hyperparameters, {name: sources[source] for name, source in channels.items()})
    monkeypatch.setenv("ATELIER_OPT_ML", str(root))
    assert container.main(["train"]) == 1
    assert reason in (root / "output" / "failure").read_text().splitlines()[0]


@pytest.mark.parametrize("model_config", ["tiny", "tiny-sdxl"])
def test_batched_losses_are_the_per_sample_losses(model_config):
    """Several samples per call give each sample the losses it gets alone: its own noise and caption."""
    models = scoring.for_scoring(load_models(model_config, None, seed=0), torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    samples = [eval_set.EvalSample(f"k{number}", f"a {colour} dog", torch.rand(3, 32, 32, generator=generator) * 2 - 1,
                                   [32, 32, 0, 0, 32, 32])
               for number, colour in enumerate(["red", "blue", "green", "red", "grey", "pink"])]
    config = scoring.EvalConfig([100, 500, 900], seed=0, resolution=32, steps=2, guidance=5.0)
    alone = scoring.validation_losses(models, samples, config, torch.device("cpu"), per_call=1)
    batched = scoring.validation_losses(models, samples, config, torch.device("cpu"), per_call=4)  # 4, then 2
    assert torch.allclose(batched, alone, rtol=1e-4, atol=1e-7)
    assert len({round(value, 6) for value in alone[:, 0].tolist()}) == len(samples)  # the rows are not one row repeated


def test_a_gpu_call_takes_fewer_samples_the_larger_they_are_and_a_cpu_call_one():
    gpu = torch.device("cuda")
    assert scoring.samples_per_call(5, 256, gpu) == 32
    assert scoring.samples_per_call(5, 512, gpu) == 8
    assert scoring.samples_per_call(5, 1024, gpu) == 2
    assert scoring.samples_per_call(50, 1024, gpu) == 1
    assert scoring.samples_per_call(5, 256, torch.device("cpu")) == 1
