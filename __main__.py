"""`python -m selfrag`: the command line."""

from selfrag.cli import main

raise SystemExit(main())
