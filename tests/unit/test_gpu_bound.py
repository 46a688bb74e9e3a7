"""bench/train_figures.py's bound_of: what a missed goal's row says bounds it, from the run's own profile."""

import pytest

from bench.train_figures import bound_of


def line(step_s: float = 1.0, images: int = 100, data_wait: float = 0.0002) -> dict:
    return {"config": {"name": "latent512+compile", "median_step_s": step_s, "images_per_step": images,
                       "data_wait_share": data_wait}}


def profile(gpu_ms: float, shares: dict) -> dict:
    return {"gpu_ms_per_step": gpu_ms, "kind_share": shares}


KERNELS = {"convolution": 0.4, "matmul": 0.2, "attention": 0.1, "normalization": 0.2, "elementwise": 0.1}


def test_a_gpu_bound_step_names_the_ceiling_of_its_tensor_core_kernels():
    bound = bound_of(line(), profile(980.0, KERNELS), unet_tflop=2.41, vae_tflop=None)

    assert bound["gpu_busy_share"] == 0.98
    assert bound["compute_kernel_share"] == pytest.approx(0.7)
    assert bound["memory_bound_kernel_share"] == pytest.approx(0.3)
    # 100 images in 0.98 s x 70% of tensor-core time: 145.8 img/s if nothing else ran
    assert bound["ceiling_img_per_s"] == pytest.approx(145.8, abs=0.1)
    assert bound["compute_kernel_tflop_per_s"] == pytest.approx(100 * 2.41 / (0.98 * 0.7), abs=0.1)
    assert bound["verdict"].startswith("GPU kernels (98% busy): convolution 40%, matmul 20%")
    assert "145.8 img/s" in bound["verdict"]


def test_the_vae_encoder_counts_in_the_image_path_flops():
    unet_only = bound_of(line(), profile(1000.0, KERNELS), unet_tflop=2.41, vae_tflop=None)
    with_vae = bound_of(line(), profile(1000.0, KERNELS), unet_tflop=2.41, vae_tflop=1.12)

    assert with_vae["compute_kernel_tflop_per_s"] / unet_only["compute_kernel_tflop_per_s"] == pytest.approx(3.53 / 2.41, rel=1e-3)


def test_an_idle_gpu_is_a_host_bound():
    bound = bound_of(line(step_s=2.0), profile(1000.0, KERNELS), unet_tflop=2.41, vae_tflop=None)

    assert bound["gpu_busy_share"] == 0.5
    assert bound["verdict"] == "host/launch: the GPU runs kernels 50% of the step"


def test_data_wait_over_the_goal_comes_first():
    bound = bound_of(line(data_wait=0.02), profile(1000.0, KERNELS), unet_tflop=2.41, vae_tflop=None)

    assert bound["verdict"].startswith("data wait: 2.0%")


def test_without_a_profile_the_row_says_how_to_get_one():
    assert bound_of(line(), None, 2.41, None) == {"verdict": "not profiled in this run (--profile latent512+compile)"}
