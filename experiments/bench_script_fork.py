"""Benchmark: a ``target=cmd`` search of an example script, its trials forked from a script server
(``trial.launcher=auto``) vs. spawned (``trial.launcher=spawn``), in one run.

For each example script and launcher the same ``oomtune search`` runs ``--repeat`` times, the two
launchers alternating: wall time, CPU seconds of the whole process tree (``RUSAGE_CHILDREN``: the
search, its servers, keepers, scripts and the spawned confirmation), the mean wall time of a search
trial (result.json ``wall_s``, the confirmation excluded) and the answer (best.yaml's batch and
allocator string), which must be the same under both launchers. A gain is claimed only where every
forked run beats every spawned one (the ranges do not overlap). Memory figures are simulated
(virtual GPU); the timings are this machine's.

Run: python experiments/bench_script_fork.py [--repeat 2] [--out experiments/results/bench_script_fork.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import REPO, header, write_results  # noqa: E402

SCRIPTS = {   # name -> (command, budget): the examples' own commands (README, docs/training-script.md)
    "lightning_module": ("{py} examples/lightning_module.py", "128MiB"),
    "hf_trainer": ("{py} examples/hf_trainer.py", "8GiB"),
    "train_cmd": ("{py} examples/train_cmd.py --batch-size {{batch_size}}", "64MiB"),
}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_search(name: str, launcher: str, tmp: Path) -> dict:
    command, budget = SCRIPTS[name]
    run = tmp / f"{name}-{launcher}-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "oomtune", "search", "target=cmd",
            f"target.command='{command.format(py=sys.executable)}'", "device=cpu", f"budget={budget}",
            f"trial.launcher={launcher}", f"hydra.run.dir={run}"]
    cpu0, t0 = children_cpu_s(), time.monotonic()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    wall, cpu = time.monotonic() - t0, children_cpu_s() - cpu0
    if done.returncode != 0:
        raise SystemExit(f"{name} ({launcher}) exited {done.returncode}: {done.stderr.strip()[-400:]}")
    best = yaml.safe_load((run / "best.yaml").read_text())["best"]
    trials, launchers = [], set()
    for result in sorted((run / "trials").glob("trial-*/result.json")):
        record = json.loads(result.read_text())
        launchers.add(record["process"].get("launcher"))
        trials.append(record.get("wall_s") or 0.0)
    confirm = trials.pop()   # the last trial is the clean-process confirmation (spawned)
    return {"wall": wall, "cpu": cpu, "trial_s": sum(trials) / max(len(trials), 1), "trials": len(trials),
            "confirm_s": confirm, "answer": (best["batch_size"], best["alloc_conf"]), "launchers": launchers}


def _each(runs: list[dict], key: str, digits: int) -> str:
    return " / ".join(f"{r[key]:.{digits}f}" for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--scripts", default=",".join(SCRIPTS))
    parser.add_argument("--out", default=str(REPO / "experiments" / "results" / "bench_script_fork.txt"))
    args = parser.parse_args()
    text = header() + "\n"
    with tempfile.TemporaryDirectory(prefix="oomtune-bench-fork-") as tmp:
        for name in args.scripts.split(","):
            runs: dict[str, list[dict]] = {"auto": [], "spawn": []}
            for i in range(args.repeat):
                for launcher in (("auto", "spawn") if i % 2 == 0 else ("spawn", "auto")):
                    runs[launcher].append(one_search(name, launcher, Path(tmp)))
            answers = {r["answer"] for rs in runs.values() for r in rs}
            text += f"## {name}: {SCRIPTS[name][0].format(py='python')} (budget {SCRIPTS[name][1]})\n"
            for launcher, rs in runs.items():
                used = sorted(str(x) for x in set().union(*(r["launchers"] for r in rs)))
                answer = sorted(answers)[0] if len(answers) == 1 else "DIFFERS"
                text += (f"  {launcher:5}: wall {_each(rs, 'wall', 1)} s, CPU {_each(rs, 'cpu', 1)} s, "
                         f"mean search trial {_each(rs, 'trial_s', 2)} s ({rs[0]['trials']} trials; "
                         f"launchers {used}), answer {answer}\n")
            fork, spawn = runs["auto"], runs["spawn"]
            for key, label in (("wall", "wall"), ("cpu", "CPU")):
                worst_fork, best_spawn = max(r[key] for r in fork), min(r[key] for r in spawn)
                verdict = (f"{best_spawn / worst_fork:.2f}x less (every forked run below every spawned one)"
                           if worst_fork < best_spawn else "no claim: the ranges overlap")
                text += f"  {label}: {verdict}\n"
            text += f"  same answer under both launchers: {'yes' if len(answers) == 1 else 'NO: ' + str(answers)}\n"
            print(text.splitlines()[-1], flush=True)
    write_results(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
