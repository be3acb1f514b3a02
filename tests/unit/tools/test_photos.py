"""The photos of known content (tools/photos.py) and the check the rehearsal and the vision tests
make with them (the classifier itself: tests/unit/builder/test_vision_models.py, the server:
tests/server/test_vision_server.py)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from tools.photos import PHOTOS, photo_jpeg, photo_problems, top5_problem


def test_the_photos_are_shipped_photographs_encoded_as_jpeg():
    sizes = {}
    for name in PHOTOS:
        data = photo_jpeg(name)
        image = Image.open(io.BytesIO(data))
        assert image.format == "JPEG" and image.mode == "RGB"
        sizes[name] = image.size
        assert photo_jpeg(name) == data  # deterministic
    assert sizes == {"chelsea": (451, 300), "coffee": (600, 400)}


def test_a_top5_holding_an_expected_class_passes_and_one_without_names_what_came_back():
    assert top5_problem("chelsea", [285, 1, 2, 3, 4]) == ""
    assert top5_problem("coffee", np.array([1, 2, 3, 4, 504])) == ""
    assert top5_problem("coffee", [1, 2, 3, 4, 5, 967]) != ""  # sixth: outside the top 5
    problem = top5_problem("chelsea", [0, 1, 2, 3, 4], [b"tench", b"goldfish", b"shark", b"tiger shark", b"ray"])
    assert problem.startswith("chelsea (a tabby cat): none of ['Egyptian cat', 'tabby', 'tiger cat'] in the top 5")
    assert "0 tench" in problem and "\n" not in problem


def test_photo_problems_is_one_line_per_wrong_photo():
    def right(images):
        assert len(images) == len(PHOTOS)
        ids = [[*sorted(PHOTOS[name].expected)[:1], 0, 1, 2, 3] for name in PHOTOS]
        return [[b"x"] * 5] * len(ids), ids

    def random_weights(images):
        return [[b"tench"] * 5] * len(images), [[0, 1, 2, 3, 4]] * len(images)

    assert photo_problems(right) == []
    problems = photo_problems(random_weights)
    assert [p.split(" ", 1)[0] for p in problems] == list(PHOTOS)
