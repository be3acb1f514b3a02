"""python -m repo_builder --target embedded|gpu [--project-root DIR] [--output model_repository] [pipeline flags]
python -m repo_builder plan [--gpu A100-40GB | --gpu-memory 40GiB | --host] ...: the memory planner (planner/)"""

import argparse
import sys
from pathlib import Path

from .compute import TARGETS
from .pipeline import BuildContext
from .pipelines import PIPELINES
from .project import ROOT_ENV, find_project_root
from .repository import build_repository


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m repo_builder", description=__doc__)
    parser.add_argument("--target", choices=TARGETS, default="embedded")
    parser.add_argument("--project-root", type=Path,
                        help=f"the project (python_models/, ensembles/, data/); default ${ROOT_ENV}, else the "
                             f"working directory or a parent of it")
    parser.add_argument("--output", type=Path, help="default: <project root>/model_repository")
    parser.add_argument("--embedded-execution-providers", default="cpu", metavar="LIST",
                        help="embedded target: ONNX Runtime providers of the compute models, in preference "
                             "order: cpu (default), or e.g. tensorrt,cuda,cpu on a local NVIDIA GPU "
                             "(needs requirements-gpu.txt; see benchmarks/gpu.sh)")
    parser.add_argument("--pipelines", "--parts", dest="pipelines", default=",".join(PIPELINES),
                        help=f"comma-separated pipelines to build (default: all of {','.join(PIPELINES)})")
    for pipeline in PIPELINES.values():
        pipeline.add_arguments(parser)
    return parser


def parse_context(argv=None) -> tuple[BuildContext, list]:
    parser = make_parser()
    args = parser.parse_args(argv)
    names = [n for n in args.pipelines.split(",") if n]
    unknown = sorted(set(names) - set(PIPELINES))
    if unknown:
        parser.error(f"unknown pipelines {unknown}; known: {list(PIPELINES)}")
    from triton_pipelines.pipelines.onnx_runner import PROVIDERS

    unknown = set(args.embedded_execution_providers.split(",")) - set(PROVIDERS)
    if unknown:
        parser.error(f"unknown execution providers {sorted(unknown)}; choose among {list(PROVIDERS)}")
    try:
        root = find_project_root(args.project_root)
    except FileNotFoundError as error:
        parser.error(str(error))
    output = (args.output or root / "model_repository").resolve()
    context = BuildContext(target=args.target, output=output, args=args, root=root)
    return context, [PIPELINES[name] for name in names]


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        from .planner.cli import main as plan

        sys.exit(plan(argv[1:]))
    from triton_pipelines.errors import ConfigError

    try:
        build_repository(*parse_context(argv))
    except ConfigError as error:  # weights that cannot be had, a bad config: one line, no traceback
        print(f"[repo_builder] error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
