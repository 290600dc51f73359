"""The mode timeline's samples carry the engine's step and output-token counts, so that a reader (`bench serve`,
through /admin/status) gets the server's step time and token rate between any two samples."""

from __future__ import annotations

from moebius import LLM, SamplingParams
from moebius.engine.timeline import ModeTimeline


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
