"""LoRA fine-tuning (trainer/models/lora.py): a tiny base saved with save_pretrained, an adapter trained on it by
trainer.jobs.train, checkpointed and resumed, saved beside the base, reloaded with load_lora_weights and served.

Denoisers are compared by their loss on one batch with the same draws (trainer.objectives.diffusion): equal losses
for the same noised inputs mean equal predictions, whatever the family's calling convention."""

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file

from trainer.jobs import train
from trainer.models import families, lora
from trainer.models.loading import from_pretrained, load_models
from trainer.models.pipelines import build_pipeline
from trainer.objectives import numerics
from trainer.objectives.diffusion import noised_inputs, prediction_loss
from trainer.objectives.numerics import step_generator
from trainer.runtime.checkpoints import CheckpointError
from trainer.serve.generation import generate, load_pipeline
from trainer.serve.protocol import Generation

pytestmark = pytest.mark.slow(seconds=50)

CPU = torch.device("cpu")
ADAPTER_FILE = "unet/diffusion_pytorch_model.safetensors"  # a checkpoint's trained weights: the adapter's alone
PRESETS = ["tiny", "tiny-sd3", "tiny-flux"]
FAMILY = {"tiny": "unet", "tiny-sd3": "sd3", "tiny-flux": "flux"}


@pytest.fixture(scope="module", params=PRESETS)
def base(request, tmp_path_factory) -> dict:
    """A tiny pipeline of the preset's family, saved as a base is (save_pretrained)."""
    models = load_models(request.param, None, seed=0)
    folder = tmp_path_factory.mktemp(f"base-{request.param}") / "pipeline"
    build_pipeline(models, models.denoiser).save_pretrained(folder)
    return {"preset": request.param, "dir": folder}


def lora_args(base: dict, *extra: str):
    return train.parse_args(["--train-dir", "unused", "--model-dir", "unused", "--model-config", base["preset"],
                             "--train", "lora", "--pretrained", str(base["dir"]), *extra])


def noised(models, seed: int = 0):
    batch = {"pixel_values": torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed)) * 2 - 1,
             "caption": ["a red dog", "a blue cat"]}
    return noised_inputs(models, batch, CPU, step_generator(seed, 1, 0, 0, CPU))


@torch.no_grad()
def loss_of(denoiser, inputs) -> torch.Tensor:
    return prediction_loss(denoiser.eval(), inputs)


@pytest.fixture(scope="module")
def lora_run(base, tmp_path_factory, shards_dir, train_args) -> dict:
    """Three steps of an adapter (rank 4, alpha 8) on the base, checkpointed at 2 and 3; the saved adapter is the
    trained one (--final-weights trained), so it is the step-3 checkpoint's."""
    root = tmp_path_factory.mktemp(f"lora-{base['preset']}")
    extra = ("--model-config", base["preset"], "--train", "lora", "--pretrained", str(base["dir"]), "--lora-rank", "4",
             "--lora-alpha", "8", "--learning-rate", "1e-2", "--steps", "3", "--checkpoint-every", "2",
             "--final-weights", "trained")
    record = train.main(train_args(shards_dir, root / "model", root / "checkpoints", *extra))
    return {**base, "root": root, "model_dir": root / "model", "checkpoints": root / "checkpoints", "record": record,
            "extra": extra}


# ---------------------------------------------------------------- what a LoRA run refuses


def test_a_lora_run_without_a_pretrained_base_is_refused_before_it_starts(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--train-dir", "x", "--model-dir", "y", "--train", "lora"])
    assert "--train lora needs --pretrained" in capsys.readouterr().err


def test_pixart_has_no_lora_in_diffusers_and_is_refused():
    assert not hasattr(families.PIXART.pipeline_class, "load_lora_weights")
    assert not hasattr(families.PIXART.transformer_class, "add_adapter")
    with pytest.raises(lora.LoraError, match="a pixart model has no LoRA"):
        lora.check_run(SimpleNamespace(family=families.PIXART), SimpleNamespace(pretrained="base"))


def test_a_lora_run_whose_parts_would_not_all_come_from_the_base_is_refused(base):
    models = load_models(base["preset"], str(base["dir"]), seed=0, init_unet="random")
    with pytest.raises(lora.LoraError, match="would not come from the base"):
        lora.adapt(models, lora_args(base, "--init-unet", "random"))


# ---------------------------------------------------------------- training through the adapter


def test_only_the_adapter_trains_and_the_base_weights_stay_bit_identical(base):
    """GIVEN the base adapted and trained three steps at a high rate, WHEN the adapter is switched off, THEN the
    denoiser is the base to the bit; with it on, it predicts otherwise."""
    models = load_models(base["preset"], str(base["dir"]), seed=0)
    before = {name: tensor.clone() for name, tensor in models.denoiser.state_dict().items()}
    lora.adapt(models, lora_args(base))
    trained = [(name, p) for name, p in models.denoiser.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in name or ".lora_B." in name for name, _ in trained)
    assert all(p.dtype == torch.float32 for _, p in trained)
    inputs = noised(models)
    optimizer = torch.optim.AdamW([p for _, p in trained], lr=1e-2)
    for _ in range(3):
        prediction_loss(models.denoiser, inputs).backward()
        optimizer.step()
        optimizer.zero_grad()
    frozen = {name.replace(".base_layer", ""): tensor for name, tensor in models.denoiser.state_dict().items()
              if "lora_" not in name}
    assert frozen.keys() == before.keys() and all(torch.equal(frozen[name], before[name]) for name in before)
    base_loss = loss_of(lora.base_denoiser(models), inputs)
    adapted_loss = loss_of(models.denoiser, inputs)
    models.denoiser.disable_adapters()
    assert torch.equal(loss_of(models.denoiser, inputs), base_loss)
    assert not torch.isclose(adapted_loss, base_loss)


def test_the_frozen_base_trains_in_bf16_on_a_gpu_unless_fsdp_shards_it():
    cuda, cpu = torch.device("cuda", 0), CPU
    assert lora.frozen_dtype(cuda, "ddp", 8) == lora.frozen_dtype(cuda, "fsdp", 1) == torch.bfloat16
    assert lora.frozen_dtype(cuda, "fsdp", 2) == torch.float32  # FSDP2 shards one dtype a group
    assert lora.frozen_dtype(cpu, "ddp", 1) == torch.float32  # no autocast on a CPU: bf16 weights would meet fp32


def test_a_base_frozen_in_bf16_trains_its_fp32_adapter_under_autocast_and_stays_as_cast(base):
    """GIVEN the base adapted with its weights frozen in bf16 (a GPU job's, lora.frozen_dtype), WHEN a step runs
    under bf16 autocast, THEN the adapter (fp32) gets gradients, the base none, and the base is its bf16 cast."""
    models = load_models(base["preset"], str(base["dir"]), seed=0)
    cast = {name: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            for name, tensor in models.denoiser.state_dict().items()}
    lora.adapt(models, lora_args(base), torch.bfloat16)
    parameters = dict(models.denoiser.named_parameters())
    assert {p.dtype for name, p in parameters.items() if "lora_" in name} == {torch.float32}
    assert {p.dtype for name, p in parameters.items() if "lora_" not in name} == {torch.bfloat16}
    with torch.autocast("cpu", torch.bfloat16):
        loss = prediction_loss(models.denoiser, noised(models))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for name, p in parameters.items() if "lora_B" in name)
    assert all(p.grad is None for name, p in parameters.items() if "lora_" not in name)
    frozen = {name.replace(".base_layer", ""): tensor for name, tensor in models.denoiser.state_dict().items()
              if "lora_" not in name}
    assert frozen.keys() == cast.keys() and all(torch.equal(frozen[name], cast[name]) for name in cast)


def test_a_job_under_bf16_autocast_trains_its_adapter_on_a_base_frozen_in_bf16(base, shards_dir, train_args, tmp_path,
                                                                              monkeypatch):
    """GIVEN steps under bf16 autocast (a GPU's numerics, here on the CPU), WHEN a LoRA job runs (its validation
    sampling too), THEN its base trained frozen in bf16 (lora.frozen_dtype) and its fp32 adapter was saved."""
    monkeypatch.setattr(numerics, "AUTOCAST_DEVICE_TYPES", frozenset({"cpu"}))
    adapted, add_adapter = [], lora.add_adapter
    monkeypatch.setattr(lora, "add_adapter",
                        lambda denoiser, *rest: (adapted.append(denoiser), add_adapter(denoiser, *rest)))
    train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "checkpoints", "--model-config", base["preset"],
                          "--train", "lora", "--pretrained", str(base["dir"]), "--steps", "2",
                          "--final-weights", "trained"))
    (denoiser,) = adapted
    assert {p.dtype for name, p in denoiser.named_parameters() if "lora_" not in name} == {torch.bfloat16}
    saved = load_file(tmp_path / "model" / lora.ADAPTER_WEIGHTS)
    assert saved and {tensor.dtype for tensor in saved.values()} == {torch.float32}

def test_a_lora_checkpoint_holds_the_adapter_alone(lora_run):
    step = lora_run["checkpoints"] / "step-00000003"
    models = load_models(lora_run["preset"], str(lora_run["dir"]), seed=0)
    lora.adapt(models, lora_args(lora_run, *lora_run["extra"]))
    trainable = {name for name, p in models.denoiser.named_parameters() if p.requires_grad}
    assert set(load_file(step / ADAPTER_FILE)) == trainable
    assert set(load_file(step / "ema_unet" / "diffusion_pytorch_model.safetensors")) == trainable


def test_a_lora_checkpoint_resumes_where_the_run_was(lora_run, shards_dir, train_args, tmp_path):
    """Resumed from step 2, step 3 logs the same loss and ends with the same adapter as the run that went on."""
    record = train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "checkpoints", *lora_run["extra"],
                                   "--resume", str(lora_run["checkpoints"] / "step-00000002")))
    resumed_line, original_line = record["history"][-1], lora_run["record"]["history"][-1]
    assert resumed_line["step"] == original_line["step"] == 3 and resumed_line["loss"] == original_line["loss"]
    resumed = load_file(tmp_path / "checkpoints" / "step-00000003" / ADAPTER_FILE)
    original = load_file(lora_run["checkpoints"] / "step-00000003" / ADAPTER_FILE)
    assert resumed.keys() == original.keys() and all(torch.equal(resumed[k], original[k]) for k in original)


def test_a_lora_checkpoint_does_not_resume_a_full_run(lora_run, shards_dir, train_args, tmp_path):
    full = [value for value in lora_run["extra"] if value not in ("--train", "lora")]
    with pytest.raises(CheckpointError, match="other weights than this run trains"):
        train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "checkpoints", *full,
                              "--resume", str(lora_run["checkpoints"] / "step-00000003")))


def test_a_lora_checkpoint_does_not_resume_an_adapter_of_another_alpha(lora_run, shards_dir, train_args, tmp_path):
    """Same parameter names, another scale: the weights would mean something else."""
    other = [("16" if previous == "--lora-alpha" else value)
             for previous, value in zip(("",) + lora_run["extra"], lora_run["extra"])]
    with pytest.raises(CheckpointError, match=r"an adapter of rank 4, alpha 8 on .*, this run one of rank 4, alpha 16"):
        train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "checkpoints", *other,
                              "--resume", str(lora_run["checkpoints"] / "step-00000003")))


def test_a_lora_checkpoint_does_not_resume_on_a_changed_base(lora_run, shards_dir, train_args, tmp_path):
    """The base comes from --pretrained again on resume; its adapter continued on other base weights would be
    trained, and served, on a model it never saw."""
    # GIVEN the base copied and one of its files changed (any file: the digest is of every file a pipeline reads)
    changed = tmp_path / "base"
    shutil.copytree(lora_run["dir"], changed)
    config = changed / "scheduler" / "scheduler_config.json"
    config.write_text(config.read_text() + " ")
    extra = [str(changed) if value == str(lora_run["dir"]) else value for value in lora_run["extra"]]
    # WHEN the run's checkpoint resumes on it THEN it is refused, naming both digests
    refusal = (f"digest {lora.base_digest(lora_run['dir'])}, but --pretrained {changed} "
               f"has digest {lora.base_digest(changed)}")
    with pytest.raises(lora.LoraError, match=re.escape(refusal)):
        train.main(train_args(shards_dir, tmp_path / "model", tmp_path / "checkpoints", *extra,
                              "--resume", str(lora_run["checkpoints"] / "step-00000003")))


# ---------------------------------------------------------------- the saved model: base + adapter


def test_the_model_is_the_base_byte_for_byte_with_the_adapter_and_its_record(lora_run):
    model_dir, base_dir = lora_run["model_dir"], lora_run["dir"]
    files = lora.pipeline_files(base_dir)
    assert lora.pipeline_files(model_dir) == files
    assert all((model_dir / name).read_bytes() == (base_dir / name).read_bytes() for name in files)
    record = json.loads((model_dir / lora.ADAPTER_RECORD).read_text())
    assert record["base"] == lora_run["record"]["base"] == {
        "pretrained": str(base_dir), "digest": lora.base_digest(base_dir), "files": len(files)}
    assert (record["family"], record["rank"], record["alpha"]) == (FAMILY[lora_run["preset"]], 4, 8)
    assert record["targets"] == sorted(lora.TARGETS[record["family"]])
    assert json.loads((model_dir / "atelier-training.json").read_text())["base"] == record["base"]


def test_the_saved_adapter_reloads_with_load_lora_weights_and_predicts_as_trained(lora_run):
    models = load_models(lora_run["preset"], str(lora_run["dir"]), seed=0)
    lora.adapt(models, lora_args(lora_run, *lora_run["extra"]))
    trained = lora.sampling_denoiser(models, load_file(lora_run["checkpoints"] / "step-00000003" / ADAPTER_FILE), CPU)
    pipeline = DiffusionPipeline.from_pretrained(lora_run["model_dir"])
    pipeline.load_lora_weights(lora_run["model_dir"])
    inputs = noised(models)
    reloaded = loss_of(getattr(pipeline, lora.denoiser_folder(models)), inputs)
    assert torch.equal(reloaded, loss_of(trained, inputs))
    assert not torch.isclose(reloaded, loss_of(lora.base_denoiser(models), inputs))


def test_the_endpoint_and_the_evaluation_serve_the_base_with_the_adapter_merged(lora_run):
    models = load_models(lora_run["preset"], str(lora_run["dir"]), seed=0)
    pipeline = DiffusionPipeline.from_pretrained(lora_run["model_dir"])
    pipeline.load_lora_weights(lora_run["model_dir"])
    inputs = noised(models)
    expected = loss_of(getattr(pipeline, lora.denoiser_folder(models)), inputs)
    served = load_pipeline(lora_run["model_dir"])
    denoiser = getattr(served, lora.denoiser_folder(models))
    assert not any("lora_" in name for name, _ in denoiser.named_parameters())  # merged: the base's layers again
    assert torch.allclose(loss_of(denoiser, inputs), expected, rtol=1e-5)
    assert torch.allclose(loss_of(from_pretrained(lora_run["model_dir"]).denoiser, inputs), expected, rtol=1e-5)
    assert generate(served, Generation("a red dog", num_inference_steps=1, height=32, width=32))[0].size == (32, 32)


def test_the_endpoint_refuses_an_adapter_whose_base_files_changed(lora_run, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(lora_run["model_dir"], model_dir)
    config = model_dir / "scheduler" / "scheduler_config.json"
    config.write_text(config.read_text() + " ")
    with pytest.raises(lora.LoraError, match="refusing to serve it"):
        load_pipeline(model_dir)
