"""python -m repo_builder --target embedded|gpu [--output model_repository] [part flags]
python -m repo_builder plan [--gpu A100-40GB | --gpu-memory 40GiB | --host] ...: the memory planner (plan.py)"""

import argparse
import sys
from pathlib import Path

from .compute import TARGETS
from .part import PROJECT_ROOT, BuildContext
from .parts import PARTS
from .repository import build_repository


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m repo_builder", description=__doc__)
    parser.add_argument("--target", choices=TARGETS, default="embedded")
    parser.add_argument("--output", type=Path, default=PROJECT_ROOT / "model_repository")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated pipelines to build (default: all of {','.join(PARTS)})")
    for part in PARTS.values():
        part.add_arguments(parser)
    return parser


def parse_context(argv=None) -> tuple[BuildContext, list]:
    parser = make_parser()
    args = parser.parse_args(argv)
    names = [n for n in args.parts.split(",") if n]
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {list(PARTS)}")
    context = BuildContext(target=args.target, output=args.output.resolve(), args=args)
    return context, [PARTS[name] for name in names]


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        from .plan import main as plan

        sys.exit(plan(argv[1:]))
    build_repository(*parse_context(argv))


if __name__ == "__main__":
    main()
