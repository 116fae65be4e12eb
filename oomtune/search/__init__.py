"""``oomtune search``: the study, its trials and its outputs (see :mod:`oomtune.search.entry`).

Kept empty on purpose: the modules are imported where used (``oomtune.search.run`` imports torch
only when a search starts). This file makes the directory a regular package, so that
``setuptools.find_packages`` puts it in the wheel (without it a non-editable install had
no ``oomtune.search``).
"""
