"""`python -m steerspec` runs the CLI."""

from steerspec.cli import main

raise SystemExit(main())
