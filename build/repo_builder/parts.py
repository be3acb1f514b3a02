"""Every pipeline that goes into the repository, by name, in build order."""

from .part import Part
from .router_part import RouterPart
from .text_part import TextPart

PARTS: dict[str, Part] = {
    "text": TextPart(),
    # Its route file also adjusts other parts' compute models (canary versions).
    "router": RouterPart(),
}
