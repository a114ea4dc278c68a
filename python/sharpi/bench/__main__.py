"""`python -m sharpi.bench`: the same command as `sharpi bench`; with --worker CONFIG RESULT, one
worker run (how bench.isolation launches each configuration in its own process)."""

import sys

from .runner import main

sys.exit(main())
