"""Regenerates the vision test images in this folder (deterministic, a few KB each):

    .venv/bin/python tests/data/make_vision_samples.py

scene.jpg is a synthetic outdoor scene (sky, sun, hills, a house); the others cover every input
format and pixel mode the image endpoint accepts. No photograph is copied from anywhere.
"""

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

HERE = Path(__file__).resolve().parent


def scene(width: int = 320, height: int = 240, seed: int = 7) -> Image.Image:
    sx, sy = width / 320, height / 240
    y = np.linspace(0, 1, height)[:, None]
    sky = np.stack([90 + 100 * y, 150 + 70 * y, 235 - 30 * y], -1) * np.ones((1, width, 1))
    img = Image.fromarray(sky.astype(np.uint8))
    d = ImageDraw.Draw(img)
    s = lambda pts: [(x * sx, y * sy) for x, y in pts]  # noqa: E731
    d.ellipse(s([(240, 20), (290, 70)]), fill=(255, 230, 120))
    d.polygon(s([(0, 170), (80, 120), (170, 165), (260, 110), (320, 150), (320, 240), (0, 240)]), fill=(70, 140, 60))
    d.rectangle(s([(120, 150), (190, 205)]), fill=(180, 60, 50))
    d.polygon(s([(112, 152), (155, 118), (198, 152)]), fill=(90, 50, 40))
    d.rectangle(s([(145, 175), (162, 205)]), fill=(60, 40, 30))
    rng = np.random.default_rng(seed)
    arr = np.asarray(img.filter(ImageFilter.GaussianBlur(0.8))).astype(np.int16)
    arr += rng.integers(-6, 7, (height, width, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def main() -> None:
    base = scene()
    base.save(HERE / "scene.jpg", quality=85, optimize=True)
    small = base.resize((160, 120), Image.BILINEAR)
    # EXIF orientation 6 ("rotate 90 CW to display"): pixels stored rotated 90 CCW.
    exif = Image.Exif()
    exif[0x0112] = 6
    small.transpose(Image.Transpose.ROTATE_90).save(HERE / "scene_exif_orientation6.jpg", quality=85, exif=exif)
    rgba = small.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(small.size))
    rgba.save(HERE / "scene_alpha.png", optimize=True)
    small.save(HERE / "scene.webp", quality=80)
    small.resize((64, 48)).save(HERE / "scene.bmp")
    small.convert("CMYK").save(HERE / "scene_cmyk.jpg", quality=85)
    small.quantize(64).save(HERE / "scene_palette.png", optimize=True)
    frames = [small.quantize(32)] + [Image.new("P", small.size, i * 40) for i in range(1, 3)]
    frames[0].save(HERE / "animated.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    gray = np.asarray(small.convert("L"), dtype=np.uint16) * 257  # full 16-bit range
    Image.fromarray(gray.astype(np.uint16)).save(HERE / "gray16.png")
    Image.new("RGB", (1, 1), (200, 30, 90)).save(HERE / "pixel_1x1.png")
    base.resize((12, 480)).save(HERE / "tall_strip.png")


if __name__ == "__main__":
    main()
