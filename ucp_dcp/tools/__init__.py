"""Layer 6, the command line and what it runs: ``inspect`` (:mod:`.summary`), ``verify``, ``export``, ``plan``
(:mod:`.dryrun`), all behind one entry point (:mod:`.cli`, called by ``python -m ucp_dcp`` and ``ucp-dcp``)."""
