"""python -m triton_pipelines health [--url localhost:8000]: exit 0 when the server is ready.

The container healthcheck (docker-compose.yml, both images: the slim one has no curl). Ready is the
launcher's readiness behind the public port: Triton ready, no dead Python stub, not restarting."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def ready(url: str, timeout_s: float = 4.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=timeout_s) as response:
            return response.status == 200, f"HTTP {response.status}"
    except urllib.error.HTTPError as error:
        return False, f"HTTP {error.code}: {error.read().decode(errors='replace')[:300]}"
    except (urllib.error.URLError, OSError) as error:
        return False, str(error)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="localhost:8000", help="host:port of the public HTTP port")
    args = parser.parse_args(argv)
    ok, detail = ready(args.url)
    if not ok:
        print(f"not ready: {detail}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
