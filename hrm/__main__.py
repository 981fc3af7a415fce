"""`python -m hrm` is the `hrm` command."""

from hrm.cli import main

raise SystemExit(main())
