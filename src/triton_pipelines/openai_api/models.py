"""``GET /v1/models`` and ``GET /v1/models/{model}``: the catalog of the served models."""

from __future__ import annotations

from triton_pipelines.openai_api import protocol as proto
from triton_pipelines.openai_api.replies import reply


class ServingModels:
    def __init__(self, catalog: proto.ModelCatalog):
        self.catalog = catalog

    async def models(self, request):
        return reply(self.catalog.listing())

    async def model(self, request):
        request["model"] = request.match_info["model"]
        return reply(self.catalog.entry(request.match_info["model"]))
