"""opdkit.rollout.episodes: the episode interface. `Environment.step` keeps an episode's books (the turn as
sampled, the answer's messages, its metrics summed over the steps, done) around an environment's `respond`;
metrics are one sparse mapping, a name an environment does not write counting 0."""

from __future__ import annotations

from opdkit.rollout.episodes import (
    CALLS,
    CORRECT,
    COUNTS,
    MALFORMED,
    Environment,
    Episode,
    StepResult,
    add_metrics,
)


class Countdown(Environment):
    """Answers each turn with one tool message until the third turn; the second turn's call is malformed."""

    tools = [{"type": "function", "function": {"name": "noop"}}]

    def respond(self, episode, assistant_text):
        assert episode.messages[-1] == {"role": "assistant", "content": assistant_text}  # already appended
        if episode.turns == 3:
            return StepResult([], done=True)
        return StepResult(
            [{"role": "tool", "content": f"left {3 - episode.turns}"}],
            done=False,
            metrics={CALLS: 1, MALFORMED: int(episode.turns == 2)},
        )

    def grade(self, episode):
        return {CORRECT: episode.done and episode.messages[-1]["content"] == episode.answer}


def test_step_keeps_the_episodes_books():
    env = Countdown()
    prompt = [{"role": "user", "content": "count"}]
    ep = env.start(prompt, answer="done")
    assert isinstance(ep, Episode) and (ep.turns, ep.done, ep.metrics) == (0, False, {})
    ep.messages[0]["content"] = "changed"
    assert prompt == [{"role": "user", "content": "count"}]  # the row's messages are copied
    results = [env.step(ep, text) for text in ("a", "b", "done")]
    assert [r.done for r in results] == [False, False, True] and ep.done and ep.turns == 3
    assert [m["content"] for m in ep.messages] == ["changed", "a", "left 2", "b", "left 1", "done"]
    assert ep.metrics == {CALLS: 2, MALFORMED: 1}  # the steps' metrics summed; the last step wrote none
    assert env.grade(ep) == {CORRECT: True}


def test_metrics_add_name_by_name_and_a_missing_name_counts_zero():
    total = dict.fromkeys(COUNTS, 0.0)
    add_metrics(total, {CALLS: 2, MALFORMED: 1})
    add_metrics(total, {CALLS: 1, CORRECT: True, "own": 0.5})
    assert total[CALLS] == 3 and total[MALFORMED] == 1 and total[CORRECT] == 1 and total["own"] == 0.5
    assert all(total[k] == 0 for k in COUNTS if k not in (CALLS, MALFORMED, CORRECT))
    assert len(set(COUNTS)) == len(COUNTS) == 8
