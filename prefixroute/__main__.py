"""``python -m prefixroute`` runs the CLI."""

import sys

from prefixroute.cli import main

sys.exit(main())
