"""python -m repo_builder --target embedded|gpu [--output model_repository] [part flags]"""

import argparse
from pathlib import Path

from .compute import TARGETS
from .part import PROJECT_ROOT, BuildContext
from .parts import PARTS
from .repository import build_repository


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m repo_builder", description=__doc__)
    parser.add_argument("--target", choices=TARGETS, default="embedded")
    parser.add_argument("--output", type=Path, default=PROJECT_ROOT / "model_repository")
    for part in PARTS:
        part.add_arguments(parser)
    args = parser.parse_args(argv)
    build_repository(BuildContext(target=args.target, output=args.output.resolve(), args=args), PARTS)


if __name__ == "__main__":
    main()
