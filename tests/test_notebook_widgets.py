"""The notebooks' views: pagers are HTML with every page in them (no kernel, no widget model to lose), their
first shown page the static view; the token explorer's widget reports its callback's errors in its Output
area, and exists only where a person is watching."""

from __future__ import annotations

import html
import json
import re

import pytest

from opdkit.jobs.antidistill.report import ads_token_explorer
from opdkit.notebook import widgets
from opdkit.notebook.widgets import Pager, arm_step_browser, sample_browser


def _sample(step: int, divergence=(0.1, 0.2)) -> dict:
    return {"step": step, "prompt": "1+2", "tokens": ["3", "<|im_end|>"], "divergence": list(divergence)}


def _pages(view) -> tuple[list, str, str]:
    """(pages from the embedded JSON, the page shown without scripts, the slider's inline handler)."""
    out = view._repr_html_()
    data = re.search(r'<script type="application/json" class="opdkit-pages">(.*?)</script>', out, re.S).group(
        1
    )
    shown = re.search(r'<div class="opdkit-page">(.*?)</div><script', out, re.S).group(1)
    handler = html.unescape(re.search(r'oninput="([^"]*)"', out).group(1))
    return json.loads(data.replace("<\\/", "</")), shown, handler


def test_sample_browser_embeds_every_step_and_shows_the_last():
    samples = [_sample(10), _sample(20, (0.5, 0.9)), _sample(20, (0.3, 0.1))]
    pages, shown, handler = _pages(sample_browser(samples))
    assert [label for label, _ in pages] == ["step 10", "step 20"]
    assert shown == pages[1][1] and pages[1][1].count("<b>step 20</b>") == 2
    assert "JSON.parse" in handler and "this.value" in handler and '"' not in handler
    assert "no samples logged" in sample_browser([])._repr_html_()


def test_pager_keeps_its_pages_safe_inside_the_script_tag():
    view = Pager([("a", "<i>one</i></script><b>x</b>"), ("b", "two")], start=-1)
    pages, shown, _ = _pages(view)
    assert pages[0][1] == "<i>one</i></script><b>x</b>" and shown == "two"
    with pytest.raises(ValueError, match="at least one page"):
        Pager([])


def test_arm_browser_pages_by_step_with_every_arm():
    pages, shown, _ = _pages(arm_step_browser({"clip": [_sample(1), _sample(2)], "noclip": [_sample(2)]}))
    assert [label for label, _ in pages] == ["step 1", "step 2"] and shown == pages[0][1]
    assert "clip</h4>" in pages[1][1] and "noclip</h4>" in pages[1][1]


def test_token_explorer_is_a_widget_only_where_someone_watches(monkeypatch):
    monkeypatch.setattr(widgets, "live_wanted", lambda: False)
    shown = widgets.live_view(lambda: pytest.fail("no widget headless"), "<i>static</i>")
    assert shown.data == "<i>static</i>"
    monkeypatch.setattr(widgets, "live_wanted", lambda: True)
    assert widgets.live_view(lambda: "widget", "<i>static</i>") == "widget"


def test_token_explorer_reports_callback_errors():
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
