"""--scheduling-policy priority (vLLM's): requests run by (priority, arrival), lower first; a
running request that needs room preempts the least urgent, not the newest; first come, first
served refuses a priority other than 0. Tokens are the model's whatever the order."""

from __future__ import annotations

import pytest
from test_equivalence import hf_reference

from shardserve import LLM
from shardserve.config import EngineConfig
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore
from shardserve.server.errors import APIError
from shardserve.server.request_params import check_scheduling


def run(path: str, priorities: list[int], policy: str, **cfg) -> tuple[list[str], EngineCore, dict]:
    """Requests a-d with these priorities, added in order before any step; the order they
    finish in (one runs at a time unless `cfg` says otherwise)."""
    core = EngineCore(EngineConfig(model=path, show_progress=False, scheduling_policy=policy,
                                   **{"max_running_requests": 1} | cfg))
    reqs = {}
    for i, p in enumerate(priorities):
        rid = "abcd"[i]
        reqs[rid] = core.add_request(rid, [5 + i, 17, 42, 99, 7], SamplingParams(max_tokens=6, temperature=0,
                                                                                priority=p))
    done = []
    while core.has_unfinished():
        core.step()
        done += [r for r, q in reqs.items() if q.finish_reason and r not in done]
    return done, core, reqs


def test_lower_priority_first_then_arrival(tiny_model):
    path, model = tiny_model("llama")
    done, _, reqs = run(path, [5, 0, 5, -1], "priority")
    assert done == ["d", "b", "a", "c"]
    for i, rid in enumerate("abcd"):
        assert reqs[rid].output_token_ids == hf_reference(model, [5 + i, 17, 42, 99, 7])[0][:6]
    assert run(path, [0, 0, 0, 0], "fcfs")[0] == ["a", "b", "c", "d"]


def test_the_least_urgent_running_request_is_preempted(tiny_model):
    """Two running requests, pages for about one: under fcfs the newer one (b) gives way; under
    priority the less urgent one (a, priority 3), though it came first."""
    path, model = tiny_model("llama")
    cfg = dict(max_running_requests=2, page_size=4, num_pages=5, max_num_batched_tokens=64)
    long = SamplingParams(max_tokens=14, temperature=0)
    for policy, prio, victim in (("fcfs", (0, 0), "b"), ("priority", (3, 1), "a")):
        core = EngineCore(EngineConfig(model=path, show_progress=False, scheduling_policy=policy, **cfg))
        reqs = {rid: core.add_request(rid, [9, 8, 7, 6, 5], SamplingParams(**{**long.__dict__, "priority": p}))
                for rid, p in zip("ab", prio)}
        while core.has_unfinished():
            core.step()
        assert reqs[victim].num_preemptions > 0 and reqs["ab".replace(victim, "")].num_preemptions == 0, policy
        ref = hf_reference(model, [9, 8, 7, 6, 5])[0][:14]
        assert all(r.output_token_ids == ref for r in reqs.values())


def test_first_come_first_served_refuses_a_priority(tiny_model):
    path, _ = tiny_model("llama")
    core = EngineCore(EngineConfig(model=path, show_progress=False))
    with pytest.raises(ValueError, match=r"priority 2 needs --scheduling-policy priority"):
        core.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2, priority=2))

    class Body:
        priority = 2

    with pytest.raises(APIError, match="start it with --scheduling-policy priority"):
        check_scheduling(Body, "fcfs")
    check_scheduling(Body, "priority")
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="'priority' is not implemented with --disaggregation-mode"):
        EngineConfig(scheduling_policy="priority", disaggregation_mode="decode")
    with pytest.raises(ValueError, match="priority must be a 64-bit signed integer"):
        SamplingParams(priority=1.5)


def test_llm_generate_takes_priorities(tiny_model):
    """vLLM's LLM.generate(priority=[...]): one per prompt; outputs stay in prompt order."""
    path, model = tiny_model("llama")
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    greedy = SamplingParams(max_tokens=5, temperature=0)
    with LLM(path, scheduling_policy="priority", max_running_requests=1, show_progress=False) as llm:
        outs = llm.generate(prompts, greedy, use_tqdm=False, priority=[2, 0, 1])
        with pytest.raises(ValueError, match="priority: 2 given for 3 prompts"):
            llm.generate(prompts, greedy, use_tqdm=False, priority=[0, 1])
    assert [o.outputs[0].token_ids for o in outs] == [hf_reference(model, p)[0][:5] for p in prompts]
    with LLM(path, show_progress=False) as llm:
        with pytest.raises(ValueError, match=r"priority 2 needs --scheduling-policy priority \(LLM\(scheduling_policy"):
            llm.generate(prompts, greedy, use_tqdm=False, priority=[2, 0, 1])
