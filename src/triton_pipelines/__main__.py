"""The one command line: ``python -m triton_pipelines <command> [options]``.

    serve     run tritonserver behind nginx, supervised (``make serve``, compose, k8s)
    health    exit 0 when the server is ready (the container healthcheck)
    rollout   move a compute model between versions on a running server
    spend     spend reports from the gateway's ledger
    screen    one request-screen process (started by the launcher)
    frontend  the OpenAI-compatible /v1 frontend (started by the launcher)

``python -m triton_pipelines <command> --help`` gives each command's options.
"""

from __future__ import annotations

import importlib
import sys

from triton_pipelines.errors import ConfigError

# command → (module with a ``main(argv)``, what it does); one table for the CLI and its help.
COMMANDS = {
    "serve": ("triton_pipelines.server.launcher", "run tritonserver behind nginx, supervised"),
    "health": ("triton_pipelines.server.health", "exit 0 when the server is ready"),
    "rollout": ("triton_pipelines.ops.rollout", "move a compute model between versions"),
    "spend": ("triton_pipelines.ops.spend_report", "spend reports from the gateway's ledger"),
    "screen": ("triton_pipelines.front.screen_server", "one request-screen process (the launcher starts it)"),
    "frontend": ("triton_pipelines.openai_api.server", "the /v1 frontend (the launcher starts it)"),
}


def usage() -> str:
    lines = ["usage: python -m triton_pipelines <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"triton_pipelines: unknown command {command!r}; one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    sys.argv = [f"python -m triton_pipelines {command}", *rest]
    try:
        return module.main(rest) or 0
    except ConfigError as error:  # a file, flag or variable that breaks a rule: one line, no traceback
        print(f"python -m triton_pipelines {command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
