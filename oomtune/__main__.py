"""``python -m oomtune`` is the same as the ``oomtune`` command."""

from oomtune.cli import main

raise SystemExit(main())
