"""The ``oomtune`` sub-commands, one module each (``register(subparsers)``, ``run(args)``;
:mod:`oomtune.cli` imports them by name).

Kept empty on purpose: a command module is imported only when its command runs. This file makes
the directory a regular package, so that ``setuptools.find_packages`` puts it in the wheel (without
it a non-editable install failed every command with ``ModuleNotFoundError``).
"""
