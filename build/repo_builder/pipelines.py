"""Every pipeline that goes into the repository, by name, in build order."""

from .pipeline import Pipeline
from .router_pipeline import RouterPipeline
from .speech_pipeline import SpeechPipeline
from .text_pipeline import TextPipeline
from .vision_pipeline import VisionPipeline

PIPELINES: dict[str, Pipeline] = {
    "text": TextPipeline(),
    # Its route file also adjusts other pipelines' compute models (canary versions).
    "router": RouterPipeline(),
    "vision": VisionPipeline(),
    "speech": SpeechPipeline(),
}
