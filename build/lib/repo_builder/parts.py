"""Every pipeline that goes into the repository, by name, in build order."""

from .part import Part
from .router_part import RouterPart
from .speech_part import SpeechPart
from .text_part import TextPart
from .vision_part import VisionPart

PARTS: dict[str, Part] = {
    "text": TextPart(),
    # Its route file also adjusts other parts' compute models (canary versions).
    "router": RouterPart(),
    "vision": VisionPart(),
    "speech": SpeechPart(),
}
