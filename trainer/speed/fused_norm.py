"""GroupNorm followed by SiLU in one kernel, for diffusers' ResnetBlock2D (as MLPerf's NeMo SD submission fuses it).

`fuse_groupnorm_silu(unet)` swaps each ResnetBlock2D's `norm1` and `norm2` for `GroupNormSiLU` (the
same parameters, so optimizer, EMA and checkpoints see the same names) and its `nonlinearity`,
which after those norms only activates the 2-D time embedding, for `TimeEmbeddingSiLU`.
`unfuse_groupnorm_silu(unet)` swaps them back.

The op is `torch.ops.atelier.groupnorm_silu` (a torch.library custom op with its own backward op),
so torch.compile keeps it in the graph instead of breaking it at every block. On a CUDA tensor with
Triton present it runs the Triton kernels below: one program per (image, group) reading the group
twice (statistics, then normalise + affine + SiLU), fp32 statistics and arithmetic, the input's
dtype (bf16) out; NCHW and NHWC (channels-last) inputs both read in place through their strides.
The statistics are a sum and a sum of squares in fp32 (as apex's NHWC group norm), fine for
activations whose mean is not far larger than their spread. Elsewhere (a CPU, no Triton) the same
formulas run in PyTorch: the reference the GPU test compares the kernels with, and the CPU path.

Backward, with x^ = (x - mean) * rstd, z = x^ * w + b, y = z * sigmoid(z):
dz = dy * s * (1 + z * (1 - s)) with s = sigmoid(z); db = sum dz; dw = sum dz * x^;
dx = rstd * (dz * w - mean_g(dz * w) - x^ * mean_g(dz * w * x^)), means over each (image, group).
"""

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # a machine without Triton (CPU): the PyTorch formulas run; the kernels are never launched
    triton = tl = None

constexpr = tl.constexpr if tl is not None else None
TILE = 4096  # elements of a (spatial x channel) tile a program holds at once


def jit(function):
    return triton.jit(function) if triton is not None else function


@jit
def _forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, HW, x_sn, x_sc, x_shw, y_sn, y_sc, y_shw,
                    group_channels, groups, eps, BLOCK_HW: constexpr, BLOCK_C: constexpr):
    program = tl.program_id(0)  # image * groups + group
    image, group = program // groups, program % groups
    lanes = tl.arange(0, BLOCK_C)
    channel_mask = lanes < group_channels
    channels = (group * group_channels + lanes).to(tl.int64)
    rows = tl.arange(0, BLOCK_HW)
    sums = tl.zeros([BLOCK_HW, BLOCK_C], dtype=tl.float32)
    squares = tl.zeros([BLOCK_HW, BLOCK_C], dtype=tl.float32)
    for start in range(0, HW, BLOCK_HW):
        spatial = (start + rows).to(tl.int64)
        mask = (spatial < HW)[:, None] & channel_mask[None, :]
        offsets = image.to(tl.int64) * x_sn + spatial[:, None] * x_shw + channels[None, :] * x_sc
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        sums += x
        squares += x * x
    count = group_channels * HW
    mean = tl.sum(tl.sum(sums, axis=1), axis=0) / count
    variance = tl.maximum(tl.sum(tl.sum(squares, axis=1), axis=0) / count - mean * mean, 0.0)
    rstd = 1.0 / tl.sqrt(variance + eps)
    tl.store(mean_ptr + program, mean)
    tl.store(rstd_ptr + program, rstd)
    scale = tl.load(w_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32) * rstd
    shift = tl.load(b_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32) - mean * scale
    for start in range(0, HW, BLOCK_HW):
        spatial = (start + rows).to(tl.int64)
        mask = (spatial < HW)[:, None] & channel_mask[None, :]
        offsets = image.to(tl.int64) * x_sn + spatial[:, None] * x_shw + channels[None, :] * x_sc
        z = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * scale[None, :] + shift[None, :]
        out = image.to(tl.int64) * y_sn + spatial[:, None] * y_shw + channels[None, :] * y_sc
        tl.store(y_ptr + out, (z * tl.sigmoid(z)).to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _backward_kernel(dy_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, C, HW,
                     x_sn, x_sc, x_shw, dy_sn, dy_sc, dy_shw, dx_sn, dx_sc, dx_shw, group_channels, groups,
                     BLOCK_HW: constexpr, BLOCK_C: constexpr):
    program = tl.program_id(0)
    image, group = program // groups, program % groups
    lanes = tl.arange(0, BLOCK_C)
    channel_mask = lanes < group_channels
    channels = (group * group_channels + lanes).to(tl.int64)
    rows = tl.arange(0, BLOCK_HW)
    mean = tl.load(mean_ptr + program)
    rstd = tl.load(rstd_ptr + program)
    w = tl.load(w_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)
    dz_sums = tl.zeros([BLOCK_HW, BLOCK_C], dtype=tl.float32)
    dz_xhat_sums = tl.zeros([BLOCK_HW, BLOCK_C], dtype=tl.float32)
    for start in range(0, HW, BLOCK_HW):
        spatial = (start + rows).to(tl.int64)
        mask = (spatial < HW)[:, None] & channel_mask[None, :]
        x = tl.load(x_ptr + image.to(tl.int64) * x_sn + spatial[:, None] * x_shw + channels[None, :] * x_sc,
                    mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + image.to(tl.int64) * dy_sn + spatial[:, None] * dy_shw + channels[None, :] * dy_sc,
                     mask=mask, other=0.0).to(tl.float32)
        xhat = (x - mean) * rstd
        z = xhat * w[None, :] + b[None, :]
        s = tl.sigmoid(z)
        dz = tl.where(mask, dy * s * (1.0 + z * (1.0 - s)), 0.0)
        dz_sums += dz
        dz_xhat_sums += dz * xhat
    db = tl.sum(dz_sums, axis=0)  # this image's share of each channel's bias and weight gradients
    dw = tl.sum(dz_xhat_sums, axis=0)
    tl.store(db_ptr + image.to(tl.int64) * C + channels, db, mask=channel_mask)
    tl.store(dw_ptr + image.to(tl.int64) * C + channels, dw, mask=channel_mask)
    count = group_channels * HW
    mean_dxhat = tl.sum(db * w, axis=0) / count  # w is constant per channel: sum(dz * w) = sum_c w_c * db_c
    mean_dxhat_xhat = tl.sum(dw * w, axis=0) / count
    for start in range(0, HW, BLOCK_HW):
        spatial = (start + rows).to(tl.int64)
        mask = (spatial < HW)[:, None] & channel_mask[None, :]
        x = tl.load(x_ptr + image.to(tl.int64) * x_sn + spatial[:, None] * x_shw + channels[None, :] * x_sc,
                    mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + image.to(tl.int64) * dy_sn + spatial[:, None] * dy_shw + channels[None, :] * dy_sc,
                     mask=mask, other=0.0).to(tl.float32)
        xhat = (x - mean) * rstd
        z = xhat * w[None, :] + b[None, :]
        s = tl.sigmoid(z)
        dxhat = dy * s * (1.0 + z * (1.0 - s)) * w[None, :]
        dx = rstd * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat)
        out = image.to(tl.int64) * dx_sn + spatial[:, None] * dx_shw + channels[None, :] * dx_sc
        tl.store(dx_ptr + out, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def flat_strides(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """(image, channel, spatial) strides of a 4-D tensor whose H and W flatten into one index, else None."""
    if tensor.stride(2) != tensor.shape[3] * tensor.stride(3):
        return None
    return tensor.stride(0), tensor.stride(1), tensor.stride(3)


def readable(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    strides = flat_strides(tensor)
    if strides is None:
        tensor = tensor.contiguous()
        strides = flat_strides(tensor)
    return tensor, strides


def launch_shape(group_channels: int, spatial: int) -> dict:
    block_c = max(triton.next_power_of_2(group_channels), 2)
    block_hw = max(min(triton.next_power_of_2(spatial), TILE // block_c), 2)
    return {"BLOCK_HW": block_hw, "BLOCK_C": block_c, "num_warps": 8 if block_hw * block_c >= 2048 else 4}


def triton_forward(x, weight, bias, groups: int, eps: float):
    n, c, h, w = x.shape
    y = torch.empty_like(x)  # x's strides (those the fake promises), whatever x is read through
    x, x_strides = readable(x)
    mean = torch.empty(n, groups, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    _forward_kernel[(n * groups,)](x, weight.contiguous(), bias.contiguous(), y, mean, rstd, h * w, *x_strides,
                                   *flat_strides(y), c // groups, groups, eps, **launch_shape(c // groups, h * w))
    return y, mean, rstd


def triton_backward(dy, x, weight, bias, mean, rstd, groups: int):
    n, c, h, w = x.shape
    dx = torch.empty_like(x)
    x, x_strides = readable(x)
    dy, dy_strides = readable(dy)
    dw_parts = torch.empty(n, c, device=x.device, dtype=torch.float32)
    db_parts = torch.empty_like(dw_parts)
    _backward_kernel[(n * groups,)](dy, x, weight.contiguous(), bias.contiguous(), mean, rstd, dx, dw_parts, db_parts,
                                    c, h * w, *x_strides, *dy_strides, *flat_strides(dx), c // groups, groups,
                                    **launch_shape(c // groups, h * w))
    return dx, dw_parts.sum(0).to(weight.dtype), db_parts.sum(0).to(bias.dtype)


def channel_view(vector: torch.Tensor, ndim: int) -> torch.Tensor:
    return vector.float().view(1, -1, *([1] * (ndim - 2)))


def normalized(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, groups: int) -> torch.Tensor:
    grouped = x.float().reshape(x.shape[0], groups, -1)
    return ((grouped - mean[..., None]) * rstd[..., None]).reshape(x.shape)


def reference_forward(x, weight, bias, groups: int, eps: float):
    """The kernels' formulas in PyTorch, fp32 throughout."""
    variance, mean = torch.var_mean(x.float().reshape(x.shape[0], groups, -1), dim=-1, unbiased=False)
    rstd = (variance + eps).rsqrt()
    z = normalized(x, mean, rstd, groups) * channel_view(weight, x.ndim) + channel_view(bias, x.ndim)
    return F.silu(z), mean, rstd


def reference_backward(dy, x, weight, bias, mean, rstd, groups: int):
    xhat = normalized(x, mean, rstd, groups)
    z = xhat * channel_view(weight, x.ndim) + channel_view(bias, x.ndim)
    s = torch.sigmoid(z)
    dz = dy.float() * s * (1 + z * (1 - s))
    dims = [0, *range(2, x.ndim)]
    dxhat = (dz * channel_view(weight, x.ndim)).reshape(x.shape[0], groups, -1)
    xhat = xhat.reshape(x.shape[0], groups, -1)
    dx = rstd[..., None] * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return dx.reshape(x.shape), (dz * xhat.reshape(x.shape)).sum(dims), dz.sum(dims)


def runs_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.ndim == 4


def like(result: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """`result` in `template`'s dtype and strides (what the fake implementations promise the compiler)."""
    out = torch.empty_like(template)
    return out.copy_(result)


@torch.library.custom_op("atelier::groupnorm_silu", mutates_args=())
def groupnorm_silu_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(silu(group_norm(x)), each (image, group)'s mean and 1 / std in fp32)."""
    if runs_triton(x):
        return triton_forward(x, weight, bias, groups, eps)
    y, mean, rstd = reference_forward(x, weight, bias, groups, eps)
    return like(y, x), mean, rstd


@groupnorm_silu_op.register_fake
def _(x, weight, bias, groups, eps):
    stats = x.new_empty((x.shape[0], groups), dtype=torch.float32)
    return torch.empty_like(x), stats, torch.empty_like(stats)


@torch.library.custom_op("atelier::groupnorm_silu_backward", mutates_args=())
def groupnorm_silu_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                               mean: torch.Tensor, rstd: torch.Tensor,
                               groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if runs_triton(x):
        return triton_backward(dy, x, weight, bias, mean, rstd, groups)
    dx, dw, db = reference_backward(dy, x, weight, bias, mean, rstd, groups)
    return like(dx, x), dw.to(weight.dtype), db.to(bias.dtype)


@groupnorm_silu_backward_op.register_fake
def _(dy, x, weight, bias, mean, rstd, groups):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, groups, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.groups = groups


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = groupnorm_silu_backward_op(dy, x, weight, bias, mean, rstd, ctx.groups)
    return dx, dw, db, None, None


groupnorm_silu_op.register_autograd(_backward, setup_context=_setup_context)


def groupnorm_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """silu(group_norm(x, groups, weight, bias, eps)), fused."""
    return groupnorm_silu_op(x, weight, bias, groups, eps)[0]


class GroupNormSiLU(torch.nn.GroupNorm):
    """torch.nn.GroupNorm followed by SiLU, one op (4-D affine inputs; anything else runs the two modules' ops)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4 or not self.affine:
            return F.silu(super().forward(x))
        return groupnorm_silu(x, self.weight, self.bias, self.num_groups, self.eps)


class TimeEmbeddingSiLU(torch.nn.Module):
    """A fused ResnetBlock2D's `nonlinearity`: its forward also calls it on the 2-D time embedding, which still
    needs the SiLU, and on the 4-D feature maps its fused norms have already activated, which pass through."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.ndim == 4 else F.silu(x)


def swapped(norm: torch.nn.GroupNorm, kind: type) -> torch.nn.GroupNorm:
    """`norm` as a `kind` module holding the same parameter objects."""
    new = kind(norm.num_groups, norm.num_channels, norm.eps, norm.affine, device="meta")
    new.weight, new.bias = norm.weight, norm.bias
    return new.train(norm.training)


def fusable(block) -> bool:
    """A ResnetBlock2D whose norm1 -> SiLU and norm2 -> SiLU pairs are adjacent in its forward."""
    return (block.time_embedding_norm == "default" and type(block.nonlinearity) is torch.nn.SiLU
            and all(type(norm) is torch.nn.GroupNorm and norm.affine for norm in (block.norm1, block.norm2)))


def fuse_groupnorm_silu(unet: torch.nn.Module) -> int:
    """Swap, in place, every fusable ResnetBlock2D's norm -> SiLU pairs for GroupNormSiLU; the number swapped."""
    from diffusers.models.resnet import ResnetBlock2D
    blocks = [module for module in unet.modules() if isinstance(module, ResnetBlock2D) and fusable(module)]
    for block in blocks:
        block.norm1, block.norm2 = swapped(block.norm1, GroupNormSiLU), swapped(block.norm2, GroupNormSiLU)
        block.nonlinearity = TimeEmbeddingSiLU()
    return len(blocks)


def unfuse_groupnorm_silu(unet: torch.nn.Module) -> int:
    """Undo fuse_groupnorm_silu: plain GroupNorm and SiLU modules, the same parameters; the number restored."""
    blocks = [module for module in unet.modules()
              if isinstance(getattr(module, "nonlinearity", None), TimeEmbeddingSiLU)]
    for block in blocks:
        block.norm1, block.norm2 = swapped(block.norm1, torch.nn.GroupNorm), swapped(block.norm2, torch.nn.GroupNorm)
        block.nonlinearity = torch.nn.SiLU()
    return len(blocks)
