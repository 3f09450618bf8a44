"""`python -m fastbert.bench` is `fastbert bench` without needing the console script installed."""
import sys

from fastbert.bench.cli import main

sys.exit(main())
