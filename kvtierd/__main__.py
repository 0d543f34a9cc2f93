"""``python -m kvtierd`` runs the daemon, like the ``kvtierd`` command."""

from .cli import daemon_main

raise SystemExit(daemon_main())
