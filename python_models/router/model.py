"""BLS router: ``task`` + JSON ``payload`` (+ ``latency_class``) → ``result`` JSON.

``execute`` starts one task per request and returns at once; each task answers through its own
response sender, so no request waits for another (a slow gateway call holds up nothing else).
Logic: ``triton_pipelines.router_service`` (handling, bounds, deadlines), ``routing`` (parsing,
routes, canary), ``gateway`` (the external route)."""

import asyncio
import os
from pathlib import Path

import triton_python_backend_utils as pb_utils

from triton_pipelines.backend import model_parameters, response_error
from triton_pipelines.gateway import GatewayClient
from triton_pipelines.router_service import RouterService
from triton_pipelines.routing import RouteError, Router, RouteTable, SplitFile
from triton_pipelines.stub.bls import bls_outputs
from triton_pipelines.stub.metrics import RouterMetrics

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        model_dir = Path(args["model_repository"])
        table = RouteTable.load(model_dir / args["model_version"] / "routes.yaml")
        split_path = os.environ.get("ROUTER_SPLIT_FILE") or parameters.get("split_file") or model_dir / "splits.json"
        self.gateway = GatewayClient(table.gateway)
        self.service = RouterService(Router(table, SplitFile(split_path, table.canaries)), self.gateway,
                                     self.call_triton, RouterMetrics(), pb_utils.Logger.log_error)
        self.tasks = set()
        self.refresher = None
        pb_utils.Logger.log_info(f"router: {len(table.tasks)} tasks; split file {split_path}; external gateway "
                                 + ("configured" if self.gateway.configured else "not configured"))

    async def execute(self, requests):
        if self.refresher is None:  # the stub's event loop exists from the first execute on
            self.refresher = asyncio.get_running_loop().create_task(self.service.refresh_circuits())
        for request in requests:
            task = asyncio.get_running_loop().create_task(self.answer(request))
            self.tasks.add(task)  # a strong reference until it is done
            task.add_done_callback(self.tasks.discard)
        return None

    async def answer(self, request):
        sender = request.get_response_sender()
        inputs = [pb_utils.get_input_tensor_by_name(request, name) for name in ("task", "payload", "latency_class")]
        answer = await self.service.handle(*(t.as_numpy() if t is not None else None for t in inputs),
                                           request.request_id() or None)
        if answer.reason:
            sender.send(pb_utils.InferenceResponse(error=response_error(answer.reason, answer.message)), flags=FINAL)
        else:
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("result", answer.result)]), flags=FINAL)

    async def call_triton(self, target, inputs, outputs):
        request = pb_utils.InferenceRequest(model_name=target, requested_output_names=list(outputs),
                                            inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()])
        try:
            response = await request.async_exec()
        except pb_utils.TritonModelException as error:
            raise RouteError("upstream_error", f"model {target}: {error}") from None
        return bls_outputs(response, target, outputs)

    def finalize(self):
        for task in list(self.tasks) + ([self.refresher] if self.refresher else []):
            task.cancel()
