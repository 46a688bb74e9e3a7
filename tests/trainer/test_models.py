"""Preset models: weights that are a pure function of the seed (every rank starts from the same ones),
and a UNet drawn on the device that trains it, the same model as the CPU's."""

import torch

from trainer.models.loading import from_preset, load_models

META = torch.device("meta")  # a device without data: stands for the GPU, which tests do not have


def layout(module: torch.nn.Module) -> dict[str, tuple]:
    """Every parameter and buffer: (shape, dtype, a parameter or not)."""
    parameters = dict(module.named_parameters())
    return {name: (tuple(tensor.shape), tensor.dtype, name in parameters) for name, tensor in
            [*module.named_parameters(), *module.named_buffers()]}


def equal(first: torch.nn.Module, second: torch.nn.Module) -> bool:
    one, other = first.state_dict(), second.state_dict()
    return one.keys() == other.keys() and all(torch.equal(one[name], other[name]) for name in one)


def test_a_preset_s_weights_are_a_pure_function_of_the_seed():
    first = from_preset("tiny", 3)
    torch.rand(1000)  # whatever the process drew before does not matter
    again = from_preset("tiny", 3)
    other = from_preset("tiny", 4)

    for part in ("denoiser", "vae"):
        assert equal(getattr(first, part), getattr(again, part)), part
        assert not equal(getattr(first, part), getattr(other, part)), part
    assert equal(first.text_encoders[0], again.text_encoders[0])
    assert not equal(first.text_encoders[0], other.text_encoders[0])


def test_the_unet_s_weights_are_drawn_on_the_training_device(monkeypatch):
    drawn_on = []  # the device of every weight the default init draws (nn.Linear, nn.Conv2d)
    kaiming_uniform = torch.nn.init.kaiming_uniform_
    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_",
                        lambda tensor, *args, **kwargs: drawn_on.append(tensor.device) or
                        kaiming_uniform(tensor, *args, **kwargs))

    unet = from_preset("tiny", 0, skip={"vae", "text_encoder"}, device=META).denoiser

    # THEN none was drawn on the CPU and copied after (866M draws on a CPU took seconds)
    assert len(drawn_on) > 0 and set(drawn_on) == {META}
    assert {tensor.device for tensor in [*unet.parameters(), *unet.buffers()]} == {META}


def test_a_unet_built_on_a_device_is_the_cpu_s_model_and_the_frozen_parts_are_the_cpu_s():
    on_cpu = load_models("tiny", None, seed=0)
    on_device = load_models("tiny", None, seed=0, device=META)

    # every parameter and buffer with its shape and dtype, the same count, the same config
    assert layout(on_device.denoiser) == layout(on_cpu.denoiser)
    assert sum(p.numel() for p in on_device.denoiser.parameters()) == sum(p.numel() for p in on_cpu.denoiser.parameters())
    assert on_device.denoiser.config == on_cpu.denoiser.config
    assert on_device.denoiser.training
    # the frozen parts are drawn on the CPU whatever trains: latent shards name them by their weights
    frozen = [*on_device.vae.parameters(), *on_device.text_encoders[0].parameters()]
    assert {tensor.device.type for tensor in frozen} == {"cpu"}
    assert equal(on_device.vae, on_cpu.vae)
    assert equal(on_device.text_encoders[0], on_cpu.text_encoders[0])
