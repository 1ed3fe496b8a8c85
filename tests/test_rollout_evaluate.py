"""Answer extraction for math datasets."""

from opdkit.data import answers


def test_boxed_extraction_handles_nesting_and_last_box():
    assert answers.extract_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert answers.extract_boxed("no box") is None
    assert answers.extract_boxed(r"\boxed{unclosed") is None
