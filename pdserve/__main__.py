from __future__ import annotations

import sys

from pdserve.cli import main

sys.exit(main())
