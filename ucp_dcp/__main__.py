"""``python -m ucp_dcp ...``: the command line (:mod:`ucp_dcp.tools.cli`, also the ``ucp-dcp`` script)."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
