"""Answer extraction for math datasets."""

from opdkit import answers as evaluate


def test_boxed_extraction_handles_nesting_and_last_box():
    assert evaluate.extract_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert evaluate.extract_boxed("no box") is None
    assert evaluate.extract_boxed(r"\boxed{unclosed") is None


def test_dapo_answer_line_is_accepted():
    text = "Work...\nAnswer: 42\n"
    assert evaluate.extract_math_answer(text) == "42"
    assert evaluate.boxed_match(text, "42")
    assert evaluate.boxed_match(r"\boxed{ 3.0 }", "3") and not evaluate.boxed_match(r"\boxed{4}", "3")
    assert evaluate.boxed_match(r"$\boxed{\dfrac{1}{2}}$", r"\frac{1}{2}")
