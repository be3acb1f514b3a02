"""BLS router: ``task`` + JSON ``payload`` (+ ``latency_class``) → ``result`` JSON.

``execute`` starts one task per request and returns at once; each task answers through its own
response sender, so no request waits for another (a slow gateway call holds up nothing else).
Logic: ``triton_pipelines.pipelines.router`` (``service``: handling, bounds, deadlines; ``router``,
``payload``, ``canary``: parsing, routes, canary), ``repository.routes`` (the route table), ``gateway_service`` (keys, budgets, spend ledger, fallbacks), ``gateway``."""

import asyncio
import os

import triton_python_backend_utils as pb_utils

from triton_pipelines.gateway.keys import KEY_ID_PARAMETER
from triton_pipelines.gateway.service import GatewayService
from triton_pipelines.limits import CLIENT_CANCEL_PARAMETER
from triton_pipelines.pipelines.router.service import RouterService
from triton_pipelines.pipelines.router.canary import SplitFile
from triton_pipelines.pipelines.router.router import Router
from triton_pipelines.repository.routes import RouteTable
from triton_pipelines.stub.bls import call_async
from triton_pipelines.stub.metrics import RouterMetrics
from triton_pipelines.stub.model_args import model_parameters, version_dir
from triton_pipelines.stub.responses import input_array, output_response, request_parameters, response_error
from triton_pipelines.stub.tracing import request_span

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        table = RouteTable.load(version_dir(args) / "routes.yaml")
        split_path = (os.environ.get("ROUTER_SPLIT_FILE") or parameters.get("split_file")
                      or version_dir(args).parent / "splits.json")
        metrics = RouterMetrics()
        # keys ($TRITON_API_KEYS_FILE), the spend ledger ($SPEND_DATABASE_URL, set by the launcher)
        self.gateway = GatewayService.from_environment(table, recorder=metrics, log=pb_utils.Logger.log_info)
        self.service = RouterService(Router(table, SplitFile(split_path, table.canaries)), self.gateway.client,
                                     call_async, metrics, pb_utils.Logger.log_error, self.gateway)
        self.gateway.publish_budgets()
        self.tasks = set()
        self.refresher = None
        pb_utils.Logger.log_info(f"router: {len(table.tasks)} tasks; split file {split_path}; external gateway "
                                 + ("configured" if self.gateway.client.configured else "not configured"))

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
        inputs = [input_array(request, name) for name in ("task", "payload", "latency_class")]
        parameters = request_parameters(request)  # the key id and cancel board id the request screen forwarded
        with request_span(request):  # its BLS and gateway calls' spans hang under it, when traced
            answer = await self.service.handle(*inputs, request.request_id() or None, parameters.get(KEY_ID_PARAMETER),
                                               parameters.get(CLIENT_CANCEL_PARAMETER))
        if answer.reason:
            sender.send(pb_utils.InferenceResponse(error=response_error(answer.reason, answer.message)), flags=FINAL)
        else:
            sender.send(output_response({"result": answer.result}), flags=FINAL)

    def finalize(self):
        for task in list(self.tasks) + ([self.refresher] if self.refresher else []):
            task.cancel()
