"""The few lines `spotpipe train` prints about what happened, from the run's events."""

from __future__ import annotations

from spotpipe.cluster.story import describe


def test_reshaping_events_are_told():
    events = [
        {"kind": "fault_injected", "time_s": 1.0, "node": "node1", "fault": "fail",
         "iteration": 4, "phase": "backward"},
        {"kind": "plan", "time_s": 1.1, "node": "launcher", "generation": 2,
         "action": "repartition", "stages": 2, "previous_partition": [[0, 1], [1, 2], [2, 4]],
         "moves": [{"kind": "layers", "pipeline": 0, "stage": 0, "src": "peers",
                    "dst": "node0"}], "resume": 5},
        {"kind": "standby", "time_s": 1.2, "node": "node5", "generation": 2},
        {"kind": "agreement", "time_s": 1.3, "node": "launcher", "generation": 2,
         "rolled_back": True},
        {"kind": "rejoining", "time_s": 1.4, "node": "node4", "generation": 3,
         "lacked": ["stage 1", "replica 0"]},
        {"kind": "plan", "time_s": 1.5, "node": "launcher", "generation": 3,
         "action": "restore_from_shadow", "stages": 2, "resume": 5,
         "moves": [{"kind": "restore", "pipeline": 0, "stage": 1, "src": "shadow",
                    "dst": "node2"}]},
        {"kind": "resumed", "time_s": 1.6, "node": "node0", "generation": 3, "iteration": 5},
        {"kind": "join_too_late", "time_s": 2.0, "node": "node6"},
        {"kind": "handed_over", "time_s": 2.1, "node": "node2", "generation": 4,
         "sent": ["stage 2 to node5", "replica 2 to node4"]},
        {"kind": "handover_failed", "time_s": 2.2, "node": "node3", "generation": 5,
         "reason": "communication failed"},
        {"kind": "notice_deferred", "time_s": 2.3, "node": "node1", "source": "AWS",
         "leaves_in_s": 89.96, "lead_s": 30.0},
        {"kind": "left_node_exited", "time_s": 2.4, "node": "node1", "returncode": 1,
         "reason": "RuntimeError: boom (log: run/logs/node1.log)"},
    ]
    text = "\n".join(describe(events, {"status": "completed", "iterations": 9, "samples": 72,
                                       "wall_s": 2.5, "final_loss": 1.5}))
    assert "repartition; P 3 -> 2" in text
    assert "node5: waits on standby" in text
    assert "rolled back" in text
    assert "node4: did not receive stage 1, replica 0" in text
    assert "node2 restores stage 1 of pipeline 0 from its CPU shadow" in text
    assert "training resumed at iteration 5 after a 0.60 s pause" in text
    assert "node6: arrived after the last iteration" in text
    assert "node2: handed stage 2 to node5, replica 2 to node4 over as it left" in text
    assert "node3: could not hand its stages over as it left (communication failed)" in text
    assert ("node1: preemption notice from AWS; trains on for 90.0 s, leaving 30.0 s before "
            "the end") in text
    assert ("node1: exited with code 1 after it left (RuntimeError: boom (log: "
            "run/logs/node1.log)); training goes on as it was") in text


def test_a_worker_that_built_the_whole_model_is_told_once_per_reason():
    why = "whole: layer 1 keeps a tensor outside its state: offset"
    events = [{"kind": "worker_ready", "time_s": 0.3, "node": f"node{i}", "built": why}
              for i in range(3)]
    events += [{"kind": "worker_ready", "time_s": 0.3, "node": "node3",
                "built": "held layers from the initial weights file"}]
    lines = describe(events, {"status": "completed", "iterations": 2, "samples": 8,
                              "wall_s": 1.0})
    told = [line for line in lines if "built the whole model" in line]
    assert told == ["      0.30s  node0: built the whole model, not only its layers (layer 1 "
                    "keeps a tensor outside its state: offset)"]
    disk = describe([{"kind": "initial_weights_not_written", "time_s": 0.0, "node": "launcher",
                      "message": "No space left on device"}], {"status": "completed"})
    assert any("initial weights were not written (No space left on device): every worker "
               "builds the whole model" in line for line in disk)


def test_a_metrics_line_written_from_the_reports_is_told():
    events = [{"kind": "metrics_recovered", "time_s": 3.2, "node": "launcher", "iteration": 7,
               "loss_known": True, "generation": 0},
              {"kind": "metrics_recovered", "time_s": 5.0, "node": "launcher", "iteration": 9,
               "loss_known": False, "generation": 1}]
    text = describe(events, {"status": "completed", "iterations": 12, "samples": 96,
                             "wall_s": 6.0, "final_loss": 1.5})
    told = [line for line in text if "metrics line" in line]
    assert told == [
        "      3.20s  iteration 7's metrics line written from the failure's reports (its record "
        "went with the failure)",
        "      5.00s  iteration 9's metrics line written from the failure's reports (its record "
        "went with the failure; its loss with a lost node)"]


def test_every_kind_of_injected_fault_is_told():
    """`--nan` and `--io-error` runs ended in a KeyError traceback (exit 1) after training,
    while the story was told: it knew only crashes, notices and hangs."""
    from spotpipe.faults import KINDS

    events = [{"kind": "fault_injected", "time_s": 1.0, "node": "node0", "fault": kind,
               "iteration": 1, "phase": "checkpoint"} for kind in KINDS]
    text = "\n".join(describe(events, {"status": "completed", "iterations": 4, "samples": 8,
                                       "wall_s": 2.0, "final_loss": 1.5}))
    for told in ("crash (SIGKILL)", "preemption notice", "hang", "NaN gradient",
                 "checkpoint write error (ENOSPC)"):
        assert f"node0: injected {told}" in text, text


def test_events_are_told_in_time_order_and_the_pause_counts_from_the_first():
    """A crash's `node_lost` (the launcher's own) reaches the file before its injection's
    event (a worker's, through the mailbox): told in file order, the loss came first and the
    pause was counted from it, 10 ms short (as the demo printed it)."""
    events = [
        {"kind": "node_lost", "time_s": 11.39, "node": "node1", "returncode": -9},
        {"kind": "fault_injected", "time_s": 11.38, "node": "node1", "fault": "fail",
         "iteration": 40, "phase": "backward"},
        {"kind": "resumed", "time_s": 11.74, "node": "node0", "generation": 1,
         "iteration": 40},
    ]
    lines = describe(events, {"status": "completed", "iterations": 150, "samples": 4800,
                              "wall_s": 30.0, "final_loss": 1.78})
    told = [line for line in lines if line.startswith("  ")]
    assert "injected crash" in told[1] and "lost (exit code -9)" in told[2], lines
    assert "after a 0.36 s pause" in told[3], lines


def test_a_fault_that_stops_no_node_starts_no_pause():
    """A NaN gradient skipped (`training.nonfinite: skip`) or a checkpoint write that failed
    stops no node, and nothing resumes after it. The next real failure's pause was counted
    from that injection: a crash at 0.63 s, resumed at 0.67 s, told as a 0.21 s pause since
    the NaN at iteration 2 (`--nan node1@2 --fail node0@9:backward`, a real run)."""
    events = [
        {"kind": "fault_injected", "time_s": 0.46, "node": "node1", "fault": "nan",
         "iteration": 2, "phase": "all-reduce"},
        {"kind": "step_skipped", "time_s": 0.47, "node": "node1", "iteration": 2},
        {"kind": "fault_injected", "time_s": 0.50, "node": "node0", "fault": "ioerror",
         "iteration": 4, "phase": "checkpoint"},
        {"kind": "fault_injected", "time_s": 0.63, "node": "node0", "fault": "fail",
         "iteration": 9, "phase": "backward"},
        {"kind": "node_lost", "time_s": 0.64, "node": "node0", "returncode": -9},
        {"kind": "resumed", "time_s": 0.67, "node": "node1", "generation": 1, "iteration": 9},
    ]
    text = "\n".join(describe(events, {"status": "completed", "iterations": 12,
                                       "samples": 96, "wall_s": 0.7, "final_loss": 3.7}))
    assert "training resumed at iteration 9 after a 0.04 s pause" in text, text
