"""Every pipeline that goes into the repository, in build order."""

from .text_part import TextPart

PARTS = [TextPart()]
