"""The mode timeline's samples carry the engine's step and output-token counts, rank 0's host, device-sync and
plan-wait times and the front end's CPU time, so that a reader (`bench serve`, through /admin/status) gets the
server's step time, token rate and where a step's time went between any two samples."""

from __future__ import annotations

import time

import pytest

from moebius import LLM, SamplingParams
from moebius.bench.serve_stats import per_step_ms
from moebius.frontend.timeline import ModeTimeline


def test_samples_keep_steps_and_tokens_at_their_interval() -> None:
    tl = ModeTimeline(start=100.0, interval=0.05)
    tl.sample(100.0, "tp", 2, 0, 0.1, steps=1, tokens=2)
    tl.sample(100.01, "tp", 2, 0, 0.1, steps=2, tokens=4)  # within the interval: skipped
    tl.sample(100.06, "tp", 1, 0, 0.1, steps=3, tokens=6)
    assert [(round(s.t, 6), s.steps, s.tokens) for s in tl.samples] == [(0.0, 1, 2), (0.06, 3, 6)]


def test_the_engine_counts_its_steps_and_tokens_into_the_samples() -> None:
    with LLM(device="cpu") as llm:
        llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
        samples = list(llm.engine.timeline.samples)
    assert len(samples) >= 2 and samples[0].steps == 1
    # both requests decode in every step; a step's tokens come back with the next (overlap scheduling)
    assert [s.tokens for s in samples] == [2 * (s.steps - 1) for s in samples]
    assert samples[-1].tokens > 0


def test_the_samples_carry_rank_zeros_times() -> None:
    """In process nothing waits for a plan; a rank process waits for its next plan while it has requests (the front
    end's turn), and not for the plan that ends its idleness."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(device="cpu") as llm:
        llm.generate([[1, 2, 3]], sp)
        samples, last = list(llm.engine.timeline.samples), llm.engine.last_times
    assert last.host_ms > 0 and last.wait_ms == 0 and all(s.rank_wait_s == 0 for s in samples)
    hosts = [s.rank_host_s for s in samples]
    assert hosts == sorted(hosts) and hosts[-1] > 0
    with LLM(device="cpu", rank_process="on") as llm:
        engine, times = llm.engine, []
        for _ in range(2):  # twice, idle for 0.3 s before each
            time.sleep(0.3)
            engine.add_request([1, 2, 3], sp)
            while engine.has_unfinished():
                engine.step()
                times.append(engine.last_times)
    first_after_idle = [0, len(times) // 2]
    assert [times[i].wait_ms for i in first_after_idle] == [0.0, 0.0]
    busy = [t.wait_ms for i, t in enumerate(times) if i not in first_after_idle]
    assert all(0 <= w < 300 for w in busy) and sum(w > 0 for w in busy) > len(busy) // 2


def test_rank_times_a_step_between_samples() -> None:
    samples = [{"run_t_s": t, "steps": n, "rank_host_s": h, "rank_sync_s": y, "rank_wait_s": w, "cpu_s": c,
                "thread_cpu_s": c / 2}
               for t, n, h, y, w, c in [(-1.0, 0, 0.0, 0.0, 0.0, 1.0), (0.5, 10, 0.05, 0.1, 0.01, 1.2),
                                        (1.0, 10, 0.05, 0.1, 0.01, 1.3), (1.5, 30, 0.15, 0.5, 0.03, 1.6)]]
    # every interval that ran steps: 30 steps, 0.15 s host, 0.5 s sync, 0.03 s waiting, 0.5 s of the server's CPU
    # (0.2 + 0.3: the CPU of the interval without steps is not counted), half of it the engine thread's
    assert per_step_ms(samples) == pytest.approx({"rank_host_ms": 5.0, "rank_sync_ms": 0.5 / 30 * 1e3,
                                                  "rank_wait_ms": 1.0, "server_cpu_ms": 0.5 / 30 * 1e3,
                                                  "engine_cpu_ms": 0.25 / 30 * 1e3})
    # the interval ending at 1.5 s alone: 20 steps, 0.1 s host, 0.4 s sync, 0.02 s waiting, 0.3 s of CPU
    assert per_step_ms(samples, 1.0, 2.0) == pytest.approx({"rank_host_ms": 5.0, "rank_sync_ms": 20.0,
                                                            "rank_wait_ms": 1.0, "server_cpu_ms": 15.0,
                                                            "engine_cpu_ms": 7.5})
    none = dict.fromkeys(("rank_host_ms", "rank_sync_ms", "rank_wait_ms", "server_cpu_ms", "engine_cpu_ms"))
    assert per_step_ms(samples, 2.0) == none
    old = [{"run_t_s": t, "steps": n} for t, n in [(0.0, 0), (1.0, 5)]]  # a server without them
    assert per_step_ms(old) == none


def test_the_samples_carry_the_front_ends_cpu_time() -> None:
    """Process and stepping-thread CPU seconds so far: they grow, and the thread's is part of the process's."""
    with LLM(device="cpu") as llm:
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        samples = list(llm.engine.timeline.samples)
    assert len(samples) >= 2
    cpu, thread = [s.cpu_s for s in samples], [s.thread_cpu_s for s in samples]
    assert cpu == sorted(cpu) and thread == sorted(thread) and cpu[-1] > cpu[0] and thread[-1] > thread[0]
    assert all(0 < t <= c for t, c in zip(thread, cpu, strict=True))


def test_every_step_taken_in_is_read_once() -> None:
    """take_times gives rank 0's times of each step taken in since the last call: with two plans ahead a step() may
    take in two results (the ranks going idle), and the server's metrics record each, not only the last."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(device="cpu", rank_process="on", plans_ahead=2) as llm:
        engine, counts = llm.engine, []
        for _ in range(2):
            engine.add_request([1, 2, 3], sp)
            while engine.has_unfinished():
                engine.step()
                counts.append(len(engine.take_times()))
        assert sum(counts) == engine.steps_taken and max(counts) == 2 and engine.take_times() == []
