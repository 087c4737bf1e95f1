"""Examples shipped with the package, runnable after ``pip install`` alone: ``python -m ucp_dcp.examples.quickstart``
(also ``ucp-dcp quickstart``). They use ucp_dcp as a user's script does (``import ucp_dcp``); nothing in the library
imports them but the command line's ``quickstart``."""
