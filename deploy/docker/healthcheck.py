"""Container HEALTHCHECK for every pdserve role.

GETs $PDSERVE_HEALTH_URL (default: the gateway's, or `pdserve up`'s,
http://127.0.0.1:8000/health; a worker container sets
http://127.0.0.1:9100/health) and exits 0 only on HTTP 200. Standard library
only: the images carry no curl or wget.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/health"


def main() -> int:
    url = os.environ.get("PDSERVE_HEALTH_URL", DEFAULT_URL)
    try:
        with urllib.request.urlopen(url, timeout=4) as response:  # noqa: S310 (fixed local URL)
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as e:
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
