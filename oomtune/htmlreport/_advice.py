"""One line per failure class: what it means and what to do (the report's failure table).

The classes are :class:`oomtune.outcome.Outcome`; the advice follows the classifier's rules
(oomtune/classify/_rules.py) and the allocator documentation (docs/source/notes/cuda.rst,
"Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF").
"""

from __future__ import annotations

__all__ = ["ADVICE", "advice_for"]

ADVICE: dict[str, str] = {
    "oom": "the batch does not fit the budget under these settings: a smaller batch, or settings that "
           "waste less (expandable_segments:True), or a larger budget",
    "oom_fragmentation": "enough memory was reserved but no free block was large enough: "
                         "expandable_segments:True or a max_split_size_mb limit fixes this before a smaller batch",
    "fraction_cap": "the per-process memory fraction (the budget) was the limit: working as intended; "
                    "raise budget= if the device has room",
    "oom_outside_allocator": "cuBLAS/cuDNN/NCCL or the driver ran out outside the caching allocator: "
                             "keep more headroom (search.headroom) since the allocator cannot see that memory",
    "host_oom": "host RAM or shared memory ran out, not the GPU: fewer data-loader workers, smaller "
                "prefetch_factor, or a larger /dev/shm",
    "limit": "a batch-size limit that is not memory (INT_MAX elements, a cuDNN algorithm): cap "
             "search.batch_size.high below it",
    "timeout": "the trial exceeded trial.timeout: raise it, or lower trial.measure_steps",
    "crash": "the process was killed by a signal: see the trial's stderr in the run's trials/ folder",
    "error": "the workload raised an error unrelated to memory: see the traceback tail in trials.json",
    "bad_record": "the script's result record was malformed (its message quotes the line): report through "
                  "oomtune.report(samples=..., seconds=...) rather than writing the results file by hand",
    "predicted_infeasible": "never launched: the virtual GPU (or a smaller batch that ran out of memory "
                            "under the same settings) showed it cannot fit",
    "interrupted": "stopped by Ctrl-C or SIGTERM: run the same command again to resume",
    "duplicate": "a probe another trial had already run or was running (another worker or process): "
                 "finished without launching anything",
    "ok >limit": "ran, but its peak is above the limit (budget minus headroom): not recommended",
}


def advice_for(outcome: str) -> str:
    """The one-line advice for an outcome value (``"oom"``, ...); a generic line for unknown ones."""
    return ADVICE.get(outcome, "see the trial's message in trials.json")
