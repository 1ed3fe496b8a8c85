"""ipywidgets views: a callback's error is shown in the view's Output area, not only in the browser
console."""

from __future__ import annotations

from opdkit.jobs.antidistill.report import ads_token_explorer
from opdkit.notebook.widgets import arm_step_browser, sample_browser


def _sample(step: int, divergence=(0.1, 0.2)) -> dict:
    return {"step": step, "prompt": "1+2", "tokens": ["3", "<|im_end|>"], "divergence": list(divergence)}


def test_sample_browser_shows_the_chosen_step_and_reports_errors_in_its_output_area():
    samples = [_sample(10), _sample(20, (0.5, 0.9))]
    view = sample_browser(samples)
    (slider, label), html, errors = view.children[0].children, view.children[1], view.children[2]
    assert label.value == "step 20"
    last = html.value
    slider.value = 0
    assert label.value == "step 10" and html.value != last and errors.outputs == ()
    samples[0]["tokens"] = None  # a broken record: the callback raises when it draws step 10 again
    slider.value = 1
    slider.value = 0
    assert len(errors.outputs) == 1 and "Traceback" in errors.outputs[0]["text"]
    slider.value = 1  # the next good draw clears the message
    assert errors.outputs == ()


def test_arm_and_token_views_report_callback_errors():
    view = arm_step_browser({"clip": [_sample(1), {**_sample(2), "tokens": None}]})
    slider, errors = view.children[0], view.children[-1]
    slider.value = 2
    assert "TypeError" in errors.outputs[0]["text"]

    def compare(index, lam, seed, method):
        if lam == 0.0:
            raise RuntimeError("no lens at λ 0")
        return {
            "prompt": "p",
            "method": method,
            "lam": lam,
            "temperature": 1.0,
            "seed": seed,
            "tokens": [],
            "plain_completion": "3",
            "plain_correct": True,
            "correct": True,
        }

    view = ads_token_explorer(compare, ["p0"], [0.0, 0.1])
    lam_slider, errors = view.children[0].children[1], view.children[-1]
    lam_slider.value = 0.0
    assert "no lens at λ 0" in errors.outputs[0]["text"]
