"""What the leader's engine reports: the Stats /metrics shows, and the counts whose change is worth
sending a new Stats message."""

from __future__ import annotations

from collections import Counter
from typing import Any

from shardserve.ipc.messages.reports import Stats

# `e` below is the leader's EngineCore (not imported: engine_core.py imports this module).
EngineCore = Any


def engine_stats(e: EngineCore) -> Stats:
    s, alloc, runner = running_status(e), e.allocator, e.runner
    return Stats(running=s["running"], waiting=s["waiting"], pages_used=s["pages_used"],
                 pages_total=s["pages_total"], prefix_hit_rate=alloc.hit_rate, prefix_hit_tokens=alloc.hits,
                 prefix_query_tokens=alloc.queries, steps=e.num_steps, finished=e.num_finished,
                 traffic=runner.comm.traffic_report(), control=e.control.traffic_report(),
                 stages=stage_traffic(e), max_in_flight=e.max_in_flight,
                 preemptions=e.scheduler.num_preemptions, empty_steps=e.empty_steps,
                 expert_routed={str(k): v for k, v in runner.expert_counts().get("routed", {}).items()},
                 speculative=e.spec.report() if e.spec is not None else {}, lora=lora_stats(e))


def lora_stats(e: EngineCore) -> dict:
    """--enable-lora: slots, slot loads so far, and requests running and waiting per adapter name."""
    if e.loras is None:
        return {}

    def by_name(reqs) -> dict[str, int]:
        return dict(Counter(r.params.lora_request.lora_name for r in reqs if r.params.lora_request is not None))

    return {"slots": e.cfg.max_loras, "slots_used": len(e.loras.slot_of), "loads": e.loras.loads,
            "running": by_name(e.scheduler.running), "waiting": by_name(e.scheduler.waiting)}


def stage_traffic(e: EngineCore) -> dict:
    """Each pipeline stage's tensor rank 0's counts by group (this stage's own, the others' reports)."""
    if e.runner.stage.count == 1:
        return {}
    return {"0": e.runner.groups.traffic_by_group()["groups"], **e.stage_traffic}


def running_status(e: EngineCore) -> dict[str, int]:
    return {
        "steps": e.num_steps,
        "finished": e.num_finished,
        "running": len(e.scheduler.running),
        "waiting": len(e.scheduler.waiting),
        "pages_used": e.allocator.num_used,
        "pages_total": e.allocator.num_pages,
        "stage_reports": e.stage_reports,
        "empty_steps": e.empty_steps,
        # Speculation's counts change only in steps, which already change "steps".
    }
