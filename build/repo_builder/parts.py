"""Every pipeline that goes into the repository, by name, in build order."""

from .part import Part
from .text_part import TextPart

PARTS: dict[str, Part] = {
    "text": TextPart(),
}
