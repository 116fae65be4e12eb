"""The Optuna study as oomtune keeps it: how a trial's record, role and settings are stored in its
attributes (:mod:`~oomtune.study.records`), and the storage it lives in (:mod:`~oomtune.study.storage`,
reconnecting through outages: :mod:`~oomtune.study.reconnect`). Below the search (which drives the
study) and the reports (which read it: :mod:`oomtune.display`, :mod:`oomtune.htmlreport`), so that
the data flows one way: config -> study -> trial process -> result -> report."""
