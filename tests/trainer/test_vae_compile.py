"""trainer.speed.vae_compile.compile_vae_encoder: the online path's VAE encoder compiled in place, same weights, same latents."""

import torch
import torch._dynamo

from trainer.models.loading import load_models
from trainer.speed.vae_compile import compile_vae_encoder, vae_encoder_eager


def posterior_parameters(models, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return models.vae.encode(pixels).latent_dist.parameters


def test_the_compiled_encoder_gives_the_eager_latents_and_keeps_its_weights():
    models = load_models("tiny", None, seed=0)
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    eager = posterior_parameters(models, pixels)
    keys = list(models.vae.state_dict())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    # aot_eager: Dynamo's and AOTAutograd's tracing without inductor's code generation (no compiler on CPU CI)
    compile_vae_encoder(models, channels_last=True, backend="aot_eager")
    compiled = posterior_parameters(models, pixels)

    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it really went through Dynamo
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert list(models.vae.state_dict()) == keys  # compiled in place: checkpoints and the saved pipeline unchanged
    weight = models.vae.encoder.conv_in.weight
    assert weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()

    vae_encoder_eager(models)
    torch._dynamo.utils.counters.clear()
    again = posterior_parameters(models, pixels)

    assert not torch._dynamo.utils.counters["stats"]  # eager again: nothing traced
    assert models.vae.encoder.conv_in.weight.is_contiguous()
    torch.testing.assert_close(again, eager, rtol=0, atol=0)
    torch._dynamo.reset()
