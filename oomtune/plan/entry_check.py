"""The check of a user's entry before any trial, in a process of its own.

Whether a ``target=python`` entry exists, is a function, and which parameters it takes (``device``,
``activation_checkpointing``) is only known by importing its module, and importing runs the user's
module-level code: a ``raise``, a ``time.sleep(10**6)`` or an ``os._exit(3)`` there took the search
(or plan) down or hung it when the import ran in its own process. :func:`check_user_code` asks the
target (:meth:`oomtune.trial._base.Target.inspect`) in a forked process under the captures' limits
(:func:`oomtune.plan.isolation.run_isolated`: ``trial.timeout``, the process group killed past it)
and hands the answer back to the target in this process (:meth:`~oomtune.trial._base.Target.
inspected`). The search's process never imports the user's module; the captures import it in their
own processes, where its module-level environment reads are recorded for the stream cache
(:mod:`oomtune.capture.reads`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oomtune.workload_spec import WorkloadSpec

__all__ = ["check_user_code"]


def check_user_code(workload: WorkloadSpec, *, timeout_s: float | None,
                    limit_name: str = "trial.timeout") -> None:
    """Import and inspect the user's code of ``workload`` (a target with ``user_code``) in a forked
    process stopped past ``timeout_s`` seconds (``limit_name`` in the message; None: no limit), and
    keep the answer in this process; nothing for oomtune's own workloads and commands.

    Raises:
        ConfigError: the entry cannot be found or is not a function (the loader's one line).
        UserCodeError: the module raised while imported (its file:line and exception), exited,
            was killed or ran past the limit; one line, before any trial.
    """
    from oomtune.plan.isolation import IMPORT_STAGE, run_isolated
    from oomtune.trial._base import get_target

    target = get_target(workload.target_name)
    target_cfg = dict(workload.target)
    if not target.user_code:
        return
    target.warm()   # oomtune's imports (torch) here: trial.timeout is the user's code's alone
    facts = run_isolated(lambda _: target.inspect(target_cfg), [0], entry=str(target_cfg.get("entry")), workers=1,
                         timeout_s=timeout_s, limit_name=limit_name, stage=IMPORT_STAGE)[0]
    target.inspected(target_cfg, facts)
