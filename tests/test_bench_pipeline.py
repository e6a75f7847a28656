"""`spotpipe bench pipeline --json --quick`: runs end to end and reports every figure.

No timing thresholds: the machine is shared and noisy; the figures are checked for being there,
finite and positive, and the two systems for computing the same first loss.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

KEYS = ["ratio_1f1b", "ratio_gpipe", "model_error",
        "spotpipe_1f1b_samples_per_s", "torch_1f1b_samples_per_s",
        "spotpipe_gpipe_samples_per_s", "torch_gpipe_samples_per_s",
        "predicted_iter_s_1f1b", "measured_iter_s_1f1b",
        "predicted_iter_s_gpipe", "measured_iter_s_gpipe", "rounds"]


def test_bench_pipeline_quick_json():
    proc = subprocess.run([sys.executable, "-m", "spotpipe", "bench", "pipeline", "--json",
                           "--quick"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in KEYS:
        assert key in figures, f"missing {key}"
        value = figures[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)
    assert isinstance(figures["config"], str) and figures["config"]
    # both systems start from the same weights on the same micro-batches: same first loss
    assert figures["first_loss_abs_diff"] < 1e-4
