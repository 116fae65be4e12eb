"""A target=cmd command that fails before its first oomtune.report() (no torch import): exit status 1
with a traceback's last line, or, with ``--report``, one report line first (the channel's format,
oomtune/script_api.py ``report``) and exit 0. For tests/test_trial_execute.py (execution.where)."""
import json
import os
import sys
import time

if "--report" in sys.argv:
    with open(os.environ["OOMTUNE_RESULT_FILE"], "a") as f:
        f.write(json.dumps({"event": "report", "time": time.time(), "samples": 8, "seconds": 0.5}) + "\n")
    sys.exit(0)
sys.stderr.write("Traceback (most recent call last):\nRuntimeError: the data loader failed\n")
sys.exit(1)
