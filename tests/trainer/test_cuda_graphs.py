"""trainer/speed/cuda_graphs.py: where CUDA graphs may run, the trainer's switch, and (on a GPU) graphed steps that
train exactly as eager ones do."""

import copy
import threading

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from trainer.jobs import train
from trainer.jobs.step import StepSettings, Trainee, train_step
from trainer.models.loading import load_models
from trainer.objectives.diffusion import Noised, noised_inputs, prediction_loss
from trainer.objectives.numerics import step_generator
from trainer.runtime.distributed import Processes
from trainer.runtime.ema import EMA
from trainer.runtime.health import Window
from trainer.speed import cuda_graphs

CPU = Processes(0, 1, 0, 1, torch.device("cpu"), None)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_graphs_run_in_one_process_on_a_cuda_device_only():
    assert cuda_graphs.usable(torch.device("cpu"), 1) == "CUDA graphs need a CUDA device"
    assert cuda_graphs.usable(torch.device("cuda", 0), 2) == \
        "CUDA graphs run in a single process (the gradient all-reduce is not captured)"
    assert cuda_graphs.usable(torch.device("cuda", 0), 1) is None


def test_asking_for_graphs_where_they_cannot_run_fails_at_start_and_auto_leaves_them_off(tmp_path):
    argv = ["--train-dir", str(tmp_path), "--model-dir", str(tmp_path / "model")]
    asked = train.parse_args([*argv, "--cuda-graphs", "true"])
    with pytest.raises(ValueError, match="^--cuda-graphs true: CUDA graphs need a CUDA device; run with "
                                         "--cuda-graphs false or auto$"):
        train.cuda_graphs_for(asked, "tiny", [32], CPU)
    assert train.cuda_graphs_for(train.parse_args(argv), "tiny", [32], CPU) is False  # auto
    assert train.cuda_graphs_for(train.parse_args([*argv, "--cuda-graphs", "false"]), "tiny", [32], CPU) is False


def test_a_graph_is_specialised_to_every_input_s_shape_and_dtype():
    def noised(batch: int, side: int, weights: bool):
        tensor = torch.zeros
        return Noised(tensor(batch, 4, side, side), tensor(batch, dtype=torch.long), tensor(batch, 77, 32),
                                  tensor(batch, 4, side, side), tensor(batch) if weights else None, None)

    assert cuda_graphs.shape_of(noised(2, 4, False)) == cuda_graphs.shape_of(noised(2, 4, False))
    assert len({cuda_graphs.shape_of(noised(*case)) for case in
                [(2, 4, False), (3, 4, False), (2, 8, False), (2, 4, True)]}) == 4


@pytest.mark.parametrize("preset", ["tiny-sd3", "tiny-flux", "tiny-pixart"])
def test_a_graph_s_static_inputs_carry_a_transformer_s_conditioning(preset):
    # GIVEN a micro-batch of a transformer family made ready for its forward: SD3 and Flux bring pooled projections,
    # PixArt an attention mask, beside the context (and Flux how its transformer reads them: packed latents)
    models = load_models(preset, None, seed=0)
    noised = noised_inputs(models, pixels_batch(0, 32, 32, CPU.device), CPU.device,
                           step_generator(0, 1, 0, 0, CPU.device))
    # WHEN its tensors are copied into a graph's static inputs and the inputs the capture reads are rebuilt from them
    static = [tensor.clone() for tensor in cuda_graphs._tensors(noised)]
    rebuilt = cuda_graphs._rebuilt(noised, static)
    # THEN every part of the conditioning is one of those copies (a replay refreshes it), and the prediction is
    # the one the micro-batch's own tensors give
    conditioning = rebuilt.conditioning
    parts = [part for part in (conditioning.context, conditioning.pooled, conditioning.mask) if part is not None]
    assert len(parts) == 2 and all(any(part is tensor for tensor in static) for part in parts)
    assert (conditioning.packed, conditioning.guidance, conditioning.positions) == (
        noised.conditioning.packed, noised.conditioning.guidance, noised.conditioning.positions)
    with torch.no_grad():
        assert prediction_loss(models.denoiser, rebuilt) == prediction_loss(models.denoiser, noised)


def pixels_batch(number: int, height: int, width: int, device) -> dict:
    pixels = torch.rand(2, 3, height, width, generator=torch.Generator().manual_seed(number)) * 2 - 1
    return {"pixel_values": pixels.to(device), "caption": ["a red circle", "a blue square"],
            "key": [f"k{number}a", f"k{number}b"], "corrupt": [], "shard": ["s.tar"], "source": [("p", "l")] * 2}


def trainee_of(unet, graphed: bool) -> Trainee:
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1.0)
    schedule = LambdaLR(optimizer, lambda done: 1e-3)
    graphs = cuda_graphs.GraphedBackward(unet, list(unet.parameters())) if graphed else None
    return Trainee(unet, unet, unet, optimizer, schedule, EMA(unet.named_parameters(), 0.9), graphs)


@needs_cuda
def test_graphed_steps_train_as_eager_steps_do_over_two_shapes_and_accumulated_micro_batches():
    # GIVEN the tiny model on the GPU, and a copy of its UNet for each way of stepping
    device = torch.device("cuda")
    processes = Processes(0, 1, 0, 1, device, None)
    models = load_models("tiny", None, seed=0, device=device)
    models.frozen_to(device)
    eager_unet, graphed_unet = models.denoiser.to(device), copy.deepcopy(models.denoiser).to(device)
    eager, graphed = trainee_of(eager_unet, False), trainee_of(graphed_unet, True)
    settings = StepSettings(seed=3, gradient_accumulation=2, snr_gamma=5.0)
    # micro-batches of two shapes in each step: two graphs, both adding into the same gradients
    batches = [pixels_batch(number, 32, 32 if number % 2 == 0 else 64, device) for number in range(16)]
    # WHEN 8 steps run each way (a shape's first two calls are eager warm-ups, the third captures)
    losses = {}
    for name, trainee in (("eager", eager), ("graphed", graphed)):
        stream, window = iter(batches), Window()
        losses[name] = [train_step(trainee, models, stream, window, settings, step, processes).loss.item()
                        for step in range(1, 9)]
    # THEN the graphs were captured and replayed, and every step's loss and the weights agree with eager
    assert len(graphed.graphs.graphs) == 2
    assert losses["graphed"] == pytest.approx(losses["eager"], rel=2e-3)
    for eager_weight, graphed_weight in zip(eager_unet.parameters(), graphed_unet.parameters()):
        torch.testing.assert_close(graphed_weight, eager_weight, rtol=2e-3, atol=2e-5)
    assert all(p.grad is None or not p.grad.any() for p in graphed_unet.parameters())  # zeroed, kept


@needs_cuda
def test_a_capture_survives_a_thread_pinning_memory_as_the_data_loader_does():
    # GIVEN a thread that keeps pinning host memory and copying it to the GPU, as the DataLoader's
    # pin-memory thread and the step's host-to-device copies do while a step is captured
    device = torch.device("cuda")
    models = load_models("tiny", None, seed=0, device=device)
    models.frozen_to(device)
    unet = models.denoiser.to(device)
    graphs = cuda_graphs.GraphedBackward(unet, list(unet.parameters()), warmup=1)
    noised = Noised(torch.randn(2, 4, 8, 8, device=device), torch.tensor([10, 500], device=device),
                    torch.randn(2, 77, unet.config.cross_attention_dim, device=device),
                    torch.randn(2, 4, 8, 8, device=device), None, None)
    stop, copies = threading.Event(), []

    def pin_and_copy() -> None:
        side = torch.cuda.Stream()
        while not stop.is_set():
            pinned = torch.empty(1 << 20, pin_memory=True)  # pinned host memory, as the loader's thread makes
            with torch.cuda.stream(side):
                copies.append(pinned.to(device, non_blocking=True).sum())

    # WHEN a shape warms up, is captured and replays while that thread runs
    worker = threading.Thread(target=pin_and_copy, daemon=True)
    worker.start()
    try:
        losses = [graphs.loss_and_backward(noised, 1.0).item() for _ in range(4)]
    finally:
        stop.set()
        worker.join()
    # THEN the graph was captured and its replays give the eager loss
    assert len(graphs.graphs) == 1 and copies
    assert losses[1:] == pytest.approx([losses[0]] * 3, rel=2e-3)


def test_auto_turns_graphs_on_where_the_fast_table_measured_them_faster(tmp_path):
    # configs/defaults/fast.json: the small preset at 256 px measured 1.37x with graphs; sd2 at 512 not faster
    on_gpu = Processes(0, 1, 0, 1, torch.device("cuda", 0), None)
    auto = train.parse_args(["--train-dir", str(tmp_path), "--model-dir", str(tmp_path / "model")])
    assert train.cuda_graphs_for(auto, "small", [256], on_gpu) is True
    assert train.cuda_graphs_for(auto, "small", [256, 512], on_gpu) is False
    assert train.cuda_graphs_for(auto, "sd2", [512], on_gpu) is False
    assert train.cuda_graphs_for(auto, "small", [256], CPU) is False
    two_processes = Processes(0, 2, 0, 1, torch.device("cuda", 0), "nccl")
    assert train.cuda_graphs_for(auto, "small", [256], two_processes) is False
    assert train.cuda_graphs_for(auto, None, [256], on_gpu) is False  # a base of no measured preset's architecture


@needs_cuda
def test_a_compiled_step_compiles_once_through_its_warm_up_calls_and_its_capture(monkeypatch):
    # GIVEN the tiny UNet compiled, as --compile true does, under CUDA graphs, and Dynamo told to fail on a
    # second compile (a guard that differs between the warm-up calls and the capture would compile it again)
    device = torch.device("cuda")
    models = load_models("tiny", None, seed=0, device=device)
    models.frozen_to(device)
    unet = models.denoiser.to(device)
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    graphs = cuda_graphs.GraphedBackward(torch.compile(unet, dynamic=False, backend="eager"), list(unet.parameters()))
    noised = Noised(torch.randn(2, 4, 8, 8, device=device), torch.tensor([10, 500], device=device),
                    torch.randn(2, 77, unet.config.cross_attention_dim, device=device),
                    torch.randn(2, 4, 8, 8, device=device), None, None)
    # WHEN the shape warms up twice, is captured and replays
    losses = [graphs.loss_and_backward(noised, 1.0).item() for _ in range(4)]
    # THEN it was captured, with no second compile, and its replays give the eager loss
    assert len(graphs.graphs) == 1
    assert losses[2:] == pytest.approx([losses[0]] * 2, rel=2e-3)
    torch._dynamo.reset()
