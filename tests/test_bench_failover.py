"""`spotpipe bench failover --json --quick`: real runs end to end, every figure reported.

No timing thresholds (the machine is shared and noisy); what must hold is structural: both
crashes and both notices were taken over, the notices replayed nothing, the crash replayed the
in-flight iteration only, and the pause splits into its parts.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys


def test_bench_failover_quick_json():
    result = subprocess.run([sys.executable, "-m", "spotpipe", "bench", "failover", "--json",
                             "--quick"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("pause_s", "pause_iterations", "restart_pause_s", "restart_over_failover_ratio",
                "torchrun_restart_pause_s", "torchrun_restart_over_failover_ratio",
                "detection_s", "agreement_s", "takeover_s", "replay_s", "notice_pause_s",
                "adjacent_notices_pause_s", "iteration_s"):
        assert isinstance(figures[key], (int, float)) and math.isfinite(figures[key]), key
        assert figures[key] > 0, key
    assert figures["crash_failovers"] == 2 and figures["notice_failovers"] == 2
    assert figures["notice_replayed_iterations"] == 0
    assert figures["adjacent_notices_replayed_iterations"] == 0
    parts = sum(figures[k] for k in ("detection_s", "agreement_s", "takeover_s", "replay_s"))
    assert parts == __import__("pytest").approx(figures["pause_s"], rel=0.05, abs=2e-3)
    assert figures["restart_lost_iterations"] >= 0
    # both restarts lose the same iterations: the same kill, the same checkpoints
    assert figures["torchrun_restart_lost_iterations"] == figures["restart_lost_iterations"]
