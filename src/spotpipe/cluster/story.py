"""What happened in a run, in a few lines a person reads after `spotpipe train` returns."""

from __future__ import annotations

from typing import Any

from spotpipe.job import NO_INITIAL_FILE
from spotpipe.runfiles import run_status

_START = ("fault_injected", "node_lost", "node_fenced", "notice", "trace_kill", "trace_notice")
# injected faults that stop no node, so that nothing resumes after them: a NaN gradient
# (skipped, or the job stops) and a checkpoint write error (the previous checkpoint stays)
_NO_PAUSE = ("nan", "ioerror")
# each kind of spotpipe.faults.KINDS, as told (an unknown one by its name: a story never fails)
_FAULTS = {"fail": "crash (SIGKILL)", "notice": "preemption notice (SIGTERM)", "hang": "hang",
           "nan": "NaN gradient", "ioerror": "checkpoint write error (ENOSPC)"}


def describe(events: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    lines = []
    incident: float | None = None
    started_by = ""  # the node whose event started the incident
    resumed_gens: set[int] = set()
    built_whole: set[str] = set()  # reasons told already (every worker may give the same)
    # in time order: a worker's events reach the file through the mailbox, after the
    # launcher's own of the same instant (a crash's `node_lost` came before its injection)
    for ev in sorted(events, key=lambda e: e["time_s"]):
        kind, t, node = ev["kind"], ev["time_s"], ev.get("node", "")
        at = f"  {t:8.2f}s"
        if kind in _START and incident is None and ev.get("fault") not in _NO_PAUSE:
            incident, started_by = t, node
        if kind == "fault_injected":
            what = _FAULTS.get(ev["fault"], str(ev["fault"]))
            lines.append(f"{at}  {node}: injected {what} at iteration {ev['iteration']}"
                         + (f", {ev['phase']}" if ev.get("phase", "start") != "start" else ""))
        elif kind in ("trace_kill", "trace_notice"):
            lines.append(f"{at}  {node}: preempted by the trace ({ev['trace_node']})")
        elif kind == "join_accepted":
            lines.append(f"{at}  {node}: joins the job")
        elif kind == "join_refused":
            lines.append(f"{at}  {node}: refused ({ev['reason']})")
        elif kind == "node_lost":
            lines.append(f"{at}  {node}: lost (exit code {ev['returncode']}"
                         + (f": {ev['reason']})" if ev.get("reason") else ")"))
        elif kind == "standby_lost":
            lines.append(f"{at}  {node}: lost while waiting to be placed (exit code "
                         f"{ev['returncode']}); training goes on as it was")
        elif kind == "left_node_exited":
            lines.append(f"{at}  {node}: exited with code {ev['returncode']} after it left"
                         + (f" ({ev['reason']})" if ev.get("reason") else "")
                         + "; training goes on as it was")
        elif kind == "node_fenced":
            lines.append(f"{at}  {node}: fenced, {ev['reason']}")
        elif kind == "notice":
            lines.append(f"{at}  {node}: preemption notice from {ev['source']}")
        elif kind == "notice_deferred":
            lines.append(f"{at}  {node}: preemption notice from {ev['source']}; trains on "
                         f"for {ev['leaves_in_s']:.1f} s"
                         + (f", leaving {ev['lead_s']:.1f} s before the end"
                            if "lead_s" in ev else ""))
        elif kind == "handed_over":
            lines.append(f"{at}  {node}: handed {', '.join(ev['sent'])} over as it left")
        elif kind == "handover_failed":
            lines.append(f"{at}  {node}: could not hand its stages over as it left "
                         f"({ev['reason']})")
        elif kind == "leaving_standby":
            lines.append(f"{at}  {node}: leaves on its notice while waiting to be placed; "
                         "training goes on as it was")
            if started_by == node:  # its notice paused nothing
                incident = None
        elif kind == "initial_weights_not_written":
            lines.append(f"{at}  the initial weights were not written ({ev['message']}): "
                         "every worker builds the whole model")
        elif kind == "worker_ready" and str(ev.get("built", "")).startswith("whole: ") and \
                ev["built"] != NO_INITIAL_FILE and \
                ev["built"] not in built_whole:
            built_whole.add(ev["built"])
            lines.append(f"{at}  {node}: built the whole model, not only its layers "
                         f"({ev['built'][len('whole: '):]})")
        elif kind == "standby":
            lines.append(f"{at}  {node}: waits on standby (no place for it in the layout)")
        elif kind == "metrics_recovered":
            lines.append(f"{at}  iteration {ev['iteration']}'s metrics line written from the "
                         "failure's reports (its record went with the failure"
                         + ("" if ev["loss_known"] else "; its loss with a lost node") + ")")
        elif kind == "rejoining":
            lines.append(f"{at}  {node}: did not receive {', '.join(ev['lacked'])} when a peer "
                         "was lost; it joins again")
        elif kind == "join_too_late":
            lines.append(f"{at}  {node}: arrived after the last iteration; not placed")
        elif kind == "agreement" and (ev.get("rolled_back") or ev.get("unreplicated")):
            if ev.get("rolled_back"):
                lines.append(f"{at}  the plan in progress is rolled back: no survivor's state "
                             "had changed yet")
            for n in ev.get("unreplicated", []):
                lines.append(f"{at}  {n}: did not receive its replica when a peer was lost; it "
                             "keeps its stages, and the next plan sends the replica again")
        elif kind == "plan":
            if ev["action"] == "stop":
                lines.append(f"{at}  plan: stop. {ev['message']}")
                continue
            lines.append(f"{at}  plan for generation {ev['generation']}: {ev['action']}; "
                         + "; ".join(_moves(ev)) + f"; resume at iteration {ev['resume']}"
                         + ("; its groups were formed ahead" if ev.get("early_groups") else ""))
        elif kind == "resumed" and ev["generation"] not in resumed_gens:
            resumed_gens.add(ev["generation"])
            pause = f" after a {t - incident:.2f} s pause" if incident is not None else ""
            lines.append(f"{at}  training resumed at iteration {ev['iteration']}{pause}")
            incident = None
    status = run_status(summary)
    head = (f"spotpipe: {status}: {summary.get('iterations')} iterations, "
            f"{summary.get('samples')} samples{_this_run(summary)} in {summary.get('wall_s')} s"
            + (f", final loss {summary['final_loss']:.4f}" if summary.get("final_loss") is not None
               else ""))
    if not lines:
        return [head, "  no preemptions or failures"]
    return [head, "  what happened:"] + lines


def _this_run(summary: dict[str, Any]) -> str:
    """What of the totals this run trained, when it resumed from a checkpoint: the totals
    count from iteration 0, and the time is this run's alone."""
    first, iterations = summary.get("first_iteration"), summary.get("iterations")
    if not isinstance(first, int) or not isinstance(iterations, int) or first <= 0:
        return ""
    return f", resumed at iteration {first}: {max(0, iterations - first)} iterations"


def _moves(plan: dict[str, Any]) -> list[str]:
    """The plan's moves in words (a re-partition as its change of depth)."""
    if plan["action"] == "repartition":
        before = len(plan.get("previous_partition", [])) or "?"
        why = plan.get("reason", "").removesuffix("; layers move peer to peer")
        return [f"P {before} -> {plan['stages']}: every node builds its new stages from the "
                "layers it holds and its peers'" + (f" ({why})" if why else "")]
    words = []
    for m in plan.get("moves", []):
        where = f"stage {m['stage']} of pipeline {m['pipeline']}"
        if m["kind"] == "promote":
            words.append(f"{m['dst']} takes over {where} from its replica")
        elif m["kind"] == "copy":
            words.append(f"{m['dst']} receives {where} from {m['src']}")
        elif m["kind"] == "restore":
            words.append(f"{m['dst']} restores {where} from its CPU shadow")
    return words or ["no stage moves"]
