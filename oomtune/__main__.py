"""``python -m oomtune`` is the same as the ``oomtune`` command."""

from oomtune.cli import console_main

console_main()
