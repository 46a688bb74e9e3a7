"""trainer.speed.master_weights: bf16 weights that follow fp32 masters held by the optimizer."""

import copy

import torch

from trainer.speed.master_weights import MasterWeights


def constant_gradient_steps(weight_module: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """`steps` SGD steps whose gradient is 1 for every weight (the loss is the weights' sum)."""
    for _ in range(steps):
        weight_module(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_updates_too_small_for_bf16_accumulate_in_the_masters():
    # GIVEN weights of 1.0, whose nearest bf16 neighbour below is 1 - 2**-8, and SGD steps of 1e-3 (under half of that)
    plain = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    torch.nn.init.ones_(plain.weight)
    mastered = copy.deepcopy(plain).float()
    weights = MasterWeights(mastered)
    # WHEN both take 10 steps
    constant_gradient_steps(plain, torch.optim.SGD(plain.parameters(), lr=1e-3), 10)
    constant_gradient_steps(mastered, weights.track(torch.optim.SGD(weights.masters.parameters(), lr=1e-3)), 10)
    # THEN bf16 alone rounded every step away; the masters moved by 10 x 1e-3 and the bf16 weights follow them
    assert torch.equal(plain.weight, torch.ones(4, 4, dtype=torch.bfloat16))
    assert torch.allclose(weights.masters.weight, torch.full((4, 4), 0.99), atol=1e-6)
    assert mastered.weight.dtype == torch.bfloat16
    assert torch.equal(mastered.weight, weights.masters.weight.to(torch.bfloat16))
    assert mastered.weight[0, 0].item() == 0.98828125  # 253/256, the bf16 number nearest 0.99


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.SiLU(), torch.nn.Linear(64, 16))


def train(model: torch.nn.Module, parameters, optimizer_of, steps: int, accumulation: int = 2) -> list[float]:
    """`steps` AdamW steps of a regression, `accumulation` micro-batches each, gradients clipped to norm 1."""
    optimizer = optimizer_of(torch.optim.AdamW(parameters, lr=1e-3, weight_decay=0.01))
    generator, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        total = 0.0
        for _ in range(accumulation):
            inputs = torch.randn(32, 16, generator=generator)
            loss = (model(inputs).float() - inputs.sin()).square().mean()
            (loss / accumulation).backward()
            total += loss.item() / accumulation
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def test_a_few_steps_match_an_fp32_reference():
    # GIVEN the same tiny model twice: fp32, and bf16 with fp32 masters
    reference, model = tiny_model(), tiny_model()
    weights = MasterWeights(model)
    # WHEN both take 8 steps of AdamW (lr 1e-3) with accumulation and clipping on the same data
    reference_losses = train(reference, list(reference.parameters()), lambda optimizer: optimizer, 8)
    losses = train(model, list(weights.masters.parameters()), weights.track, 8)
    # THEN the losses agree to 0.5% (0.02% seen) and the masters to 1% of the reference's mean movement (0.2% seen).
    # AdamW moves a weight about lr a step whatever its gradient's size, so where bf16 flips the sign of a near-zero
    # gradient one weight may differ by a few lr: the largest difference is held to 4 x lr.
    assert all(abs(ours - theirs) <= 0.005 * theirs for ours, theirs in zip(losses, reference_losses))
    start, trained = dict(tiny_model().named_parameters()), dict(reference.named_parameters())
    with torch.no_grad():
        for name, master in weights.masters.named_parameters():
            moved, off = (trained[name] - start[name]).abs(), (master - trained[name]).abs()
            assert moved.mean() > 1e-3, name  # the reference did move
            assert off.mean() <= 0.01 * moved.mean() and off.max() <= 4e-3, name


def test_restore_gives_back_fp32_weights_holding_the_masters_and_no_hooks():
    model = tiny_model()
    weights = MasterWeights(model)
    train(model, list(weights.masters.parameters()), weights.track, 2)
    weights.restore()
    for (name, param), master in zip(model.named_parameters(), weights.masters.parameters()):
        assert param.dtype == torch.float32 and torch.equal(param, master), name
    model(torch.randn(2, 16)).sum().backward()  # no hook moves the gradient away any more
    assert all(param.grad is not None for param in model.parameters())
