"""Photographs of known content for the vision checks (the tests, the rehearsal): photos that
scikit-image ships inside its wheel (``skimage.data``, bundled, no download), encoded as JPEG, and
the ImageNet-1k classes a real classifier puts in its top 5 for each."""

from __future__ import annotations

import io
from dataclasses import dataclass

TOP_K = 5


@dataclass(frozen=True)
class Photo:
    name: str  # the skimage.data function
    content: str
    expected: dict[int, str]  # ImageNet-1k class id → its name (WordNet)


PHOTOS = {
    "chelsea": Photo("chelsea", "a tabby cat", {281: "tabby", 282: "tiger cat", 285: "Egyptian cat"}),
    "coffee": Photo("coffee", "a cup of coffee", {967: "espresso", 504: "coffee mug", 968: "cup"}),
}


def photo_jpeg(name: str, quality: int = 90) -> bytes:
    """The photo ``name`` (a key of PHOTOS) as JPEG bytes."""
    import skimage.data
    from PIL import Image

    pixels = getattr(skimage.data, PHOTOS[name].name)()
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert("RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def top5_problem(name: str, class_ids, labels=()) -> str:
    """Empty when the top 5 ``class_ids`` (best first) hold one of the photo's expected classes,
    else one line saying what came back."""
    photo = PHOTOS[name]
    ids = [int(i) for i in list(class_ids)[:TOP_K]]
    if set(ids) & set(photo.expected):
        return ""
    got = ", ".join(f"{i} {label.decode() if isinstance(label, bytes) else label}"
                    for i, label in zip(ids, list(labels) or [""] * len(ids)))
    return (f"{name} ({photo.content}): none of {sorted(photo.expected.values())} in the top {TOP_K}, "
            f"got [{got}]")


def photo_problems(classify) -> list[str]:
    """Every photo through ``classify`` (a list of JPEG bytes → (labels [n, k], class_ids [n, k]),
    best first): one line per photo whose top 5 misses its classes; empty when all are right."""
    names = list(PHOTOS)
    labels, class_ids = classify([photo_jpeg(name) for name in names])
    return [problem for name, row_labels, row_ids in zip(names, labels, class_ids)
            if (problem := top5_problem(name, row_ids, row_labels))]
