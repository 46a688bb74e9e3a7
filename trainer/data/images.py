"""An image member's pixels as the VAE takes them: decoded upright in RGB, scaled to cover a bucket and
cropped to it, as a [3, H, W] tensor in [-1, 1].
"""

import io

import torch
from PIL import Image, ImageOps

from trainer.data.buckets import cover_and_crop


def crop_to_bucket(image: Image.Image, bucket: tuple[int, int], offset: tuple[float, float]) -> tuple[torch.Tensor, list[int]]:
    """(pixels [3, H, W] in [-1, 1], SDXL time ids): the image scaled to cover the bucket and cropped."""
    width, height = image.size
    resized, (left, top) = cover_and_crop(width, height, bucket, offset)
    image = image.resize(resized, Image.Resampling.BICUBIC).crop((left, top, left + bucket[0], top + bucket[1]))
    return to_tensor(image), [height, width, top, left, bucket[1], bucket[0]]  # original, crop top-left, target (h, w)


def decode_image(data: bytes, pil_format: str) -> Image.Image:
    """The member's bytes as an upright RGB image; Pillow's decompression-bomb guard stays on."""
    with Image.open(io.BytesIO(data), formats=[pil_format]) as image:
        image = ImageOps.exif_transpose(image)
        if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
            image = image.convert("RGBA")
            background = Image.new("RGBA", image.size, "white")  # transparent areas become white, not black
            return Image.alpha_composite(background, image).convert("RGB")
        return image.convert("RGB")


def to_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB image as a float tensor [3, H, W] scaled to [-1, 1], the VAE's input range."""
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(image.height, image.width, 3).permute(2, 0, 1)
    return pixels.float() / 127.5 - 1.0
