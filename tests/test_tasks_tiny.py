"""The tiny task (opdkit.tasks.tiny) as the jobs grade with it: the answer a scratchpad's own working implies,
and wrong answers told apart as a slip carried through or a contradiction of the working."""

from __future__ import annotations

from opdkit import tasks
from opdkit.data import traces
from opdkit.tasks import tiny as task


def test_error_kinds_tell_a_slip_from_a_contradiction():
    assert task.implied_answer("8+7=15,5+6+1=12,3+4+1=8;825") == "825"
    assert task.implied_answer("9+9=18,9+1+1=11,5+5+1=11;1118") == "1118"
    assert task.implied_answer("8+7=1x;825") is None
    recs = [
        traces.trace([], "8+7=15,5+6+1=12,3+4+1=8;825", correct=True),  # right
        traces.trace([], "8+7=15,5+6+1=13,3+4+1=8;835", correct=False),  # a slip carried through
        traces.trace([], "8+7=15,5+6+1=12,3+4+1=8;826", correct=False),  # answer contradicts the working
        traces.trace([], "8+7=15;", correct=False),
    ]
    assert tasks.get_task("tiny").error_kinds(recs) == {"slip": 0.25, "contradiction": 0.5}
