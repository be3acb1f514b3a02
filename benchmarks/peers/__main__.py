"""python -m benchmarks.peers {text|vision|speech} --repository DIR --port N: one FastAPI peer under
uvicorn (uvloop, httptools, one worker: ONNX Runtime's threads already use every core) on 127.0.0.1."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("pipeline", choices=("text", "vision", "speech"))
    parser.add_argument("--repository", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    os.environ["PEER_REPOSITORY"] = args.repository
    import uvicorn

    uvicorn.run(f"benchmarks.peers.{args.pipeline}:app", host="127.0.0.1", port=args.port, workers=1,
                loop="uvloop", http="httptools", log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
