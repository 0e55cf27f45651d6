"""The image's HEALTHCHECK: exit 0 when GET /health answers 200, 1 otherwise (stdlib only).

The URL is $PAGEDSERVE_HEALTH_URL, by default the server's port 8000 inside the container.
"""

from __future__ import annotations

import os
import sys
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/health"
TIMEOUT_S = 4.0  # below the HEALTHCHECK's --timeout, so a hung server reads as unhealthy here


def main() -> int:
    url = os.environ.get("PAGEDSERVE_HEALTH_URL", DEFAULT_URL)
    # No proxies: an http_proxy set for the container must not intercept a loopback request.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=TIMEOUT_S) as response:
            status = response.status
    except OSError as exc:  # refused, timed out, or an HTTP error status (HTTPError)
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"unhealthy: {url} answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
