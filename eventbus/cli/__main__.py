"""`python -m eventbus.cli`: the `eventbus` command."""

import sys

from eventbus.cli import main

sys.exit(main())
