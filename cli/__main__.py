"""`python -m selfrag.cli`: the command line (as `python -m selfrag`)."""

from selfrag.cli import main

raise SystemExit(main())
