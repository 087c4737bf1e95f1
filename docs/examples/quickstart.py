"""The quickstart moved into the package (``ucp_dcp/examples/quickstart.py``), so that it runs after ``pip install``
alone: ``python -m ucp_dcp.examples.quickstart [CKPT]`` (or ``ucp-dcp quickstart``), or one phase per torchrun job
with ``torchrun --nproc-per-node N -m ucp_dcp.examples.quickstart save|load CKPT``. This file runs the same code,
for the commands that named it:

    torchrun --nproc-per-node 2 docs/examples/quickstart.py save /tmp/ckpt
    torchrun --nproc-per-node 4 docs/examples/quickstart.py load /tmp/ckpt
"""

import sys

from ucp_dcp.examples.quickstart import main

if __name__ == "__main__":
    sys.exit(main())
