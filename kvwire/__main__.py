"""``python -m kvwire`` runs the command line."""

from kvwire.cli import main

raise SystemExit(main())
