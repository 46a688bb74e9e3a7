"""trainer.speed.fused_norm: GroupNorm + SiLU as one op, against torch.nn.GroupNorm then SiLU."""

import pytest
import torch

from trainer.models.loading import load_models
from trainer.speed import fused_norm
from trainer.speed.fused_norm import GroupNormSiLU, TimeEmbeddingSiLU, fuse_groupnorm_silu, unfuse_groupnorm_silu

# (channels, groups, height, width): SD-2's 320 channels in 32 groups, and odd group sizes and spatial sides
SHAPES = [(320, 32, 16, 16), (30, 3, 7, 5), (15, 5, 9, 1), (96, 32, 3, 3)]
LAYOUTS = [torch.contiguous_format, torch.channels_last]


def reference_and_fused(channels: int, groups: int, device: str, dtype: torch.dtype):
    """A torch.nn.GroupNorm with random affine parameters, and a GroupNormSiLU holding copies of them."""
    norm = torch.nn.GroupNorm(groups, channels, eps=1e-5).to(device)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
        norm.bias.normal_(0.0, 0.5)
    fused = GroupNormSiLU(groups, channels, eps=1e-5).to(device)
    fused.load_state_dict(norm.state_dict())
    return norm, fused


def compare(channels, groups, height, width, layout, device, dtype, tolerance):
    """Forward and backward of the fused op against GroupNorm -> SiLU in fp32 on the same (dtype-rounded) inputs."""
    torch.manual_seed(0)
    norm, fused = reference_and_fused(channels, groups, device, dtype)
    x = (torch.randn(4, channels, height, width, device=device) * 2 + 0.5).to(dtype).to(memory_format=layout)
    dy = torch.randn(4, channels, height, width, device=device).to(dtype).to(memory_format=layout)
    x_ref, x_fused = x.float().detach().requires_grad_(), x.detach().requires_grad_()
    y_ref = torch.nn.functional.silu(norm(x_ref))
    y_ref.backward(dy.float())
    y = fused(x_fused)
    y.backward(dy)
    assert y.dtype == dtype and y.shape == x.shape
    assert y.is_contiguous(memory_format=layout)
    assert torch.allclose(y.float(), y_ref, **tolerance)
    assert torch.allclose(x_fused.grad.float(), x_ref.grad, **tolerance)
    scale = {"rtol": 1e-3, "atol": 1e-3 * norm.weight.grad.abs().max().item()}  # fp32 sums over the batch
    assert torch.allclose(fused.weight.grad, norm.weight.grad, **scale)
    bias_scale = {"rtol": 1e-3, "atol": 1e-3 * norm.bias.grad.abs().max().item()}
    assert torch.allclose(fused.bias.grad, norm.bias.grad, **bias_scale)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "c{}g{}_{}x{}".format(*shape))
def test_the_reference_formulas_match_groupnorm_then_silu(shape, layout):
    # on a CPU the op runs the formulas the Triton kernels implement
    compare(*shape, layout, "cpu", torch.float32, {"rtol": 1e-4, "atol": 1e-5})


def test_the_op_stays_in_one_graph_under_torch_compile():
    torch.manual_seed(0)
    norm, fused = reference_and_fused(30, 3, "cpu", torch.float32)
    x = torch.randn(2, 30, 6, 6)
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break is an error
    assert torch.allclose(compiled(x), torch.nn.functional.silu(norm(x)), rtol=1e-4, atol=1e-5)


def test_fusing_the_unet_keeps_its_output_gradients_and_parameter_names():
    # GIVEN the tiny UNet and a copy with its ResnetBlock2D norm -> SiLU pairs fused (the PyTorch path on a CPU)
    models = load_models("tiny", None, seed=0)
    unet = models.denoiser
    names = [name for name, _ in unet.named_parameters()]
    torch.manual_seed(1)
    side = 8
    sample = torch.randn(2, unet.config.in_channels, side, side)
    context = torch.randn(2, 3, unet.config.cross_attention_dim)
    timesteps = torch.tensor([10, 500])

    def output_and_grads():
        unet.zero_grad(set_to_none=True)
        out = unet(sample, timesteps, context).sample
        out.square().mean().backward()
        return out.detach(), [param.grad.clone() for param in unet.parameters()]

    expected, expected_grads = output_and_grads()
    swapped = fuse_groupnorm_silu(unet)
    # THEN every block was swapped, with the same parameter names, and gives the same output and gradients
    assert swapped == sum(type(module).__name__ == "ResnetBlock2D" for module in unet.modules()) > 0
    assert sum(isinstance(module, GroupNormSiLU) for module in unet.modules()) == 2 * swapped
    assert sum(isinstance(module, TimeEmbeddingSiLU) for module in unet.modules()) == swapped
    assert [name for name, _ in unet.named_parameters()] == names
    fused, fused_grads = output_and_grads()
    assert torch.allclose(fused, expected, rtol=1e-4, atol=1e-5)
    assert all(torch.allclose(ours, theirs, rtol=1e-3, atol=1e-6) for ours, theirs in zip(fused_grads, expected_grads))
    # AND unfusing gives back plain modules
    assert unfuse_groupnorm_silu(unet) == swapped
    assert not any(isinstance(module, (GroupNormSiLU, TimeEmbeddingSiLU)) for module in unet.modules())


needs_triton = pytest.mark.skipif(not torch.cuda.is_available() or fused_norm.triton is None,
                                  reason="the Triton kernels need a CUDA device and Triton")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape", [*SHAPES, (960, 32, 64, 64)], ids=lambda shape: "c{}g{}_{}x{}".format(*shape))
def test_the_triton_kernels_match_groupnorm_then_silu(shape, layout, dtype):
    # bf16 out is rounded (2**-8 relative); fp32 differs from PyTorch's kernel by the order of the sums only
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    compare(*shape, layout, "cuda", dtype, tolerance)


@needs_triton
def test_the_triton_op_compiles_with_inductor_in_one_graph():
    torch.manual_seed(0)
    norm, fused = reference_and_fused(320, 32, "cuda", torch.bfloat16)
    x = torch.randn(4, 320, 32, 32, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    x.requires_grad_()
    compiled = torch.compile(fused, fullgraph=True)
    y = compiled(x)
    y.float().sum().backward()
    assert torch.allclose(y.float(), torch.nn.functional.silu(norm(x.float())), rtol=2e-2, atol=2e-2)
    assert x.grad is not None and torch.isfinite(x.grad).all()
