"""`python -m reprise_cli`."""

import sys

from reprise_cli.main import main

sys.exit(main())
