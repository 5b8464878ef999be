"""The shared answer readers: hand-written completions and the exact text each reads out of them."""

from fractions import Fraction

import pytest

from ais_lightning.tasks.answers import (
    READERS,
    boxed,
    check_readers,
    clean_expression,
    extract_answer,
    last_expression,
    last_grid,
    last_number,
    normalize_answer,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{46}.", "46"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{{46}}", "{46}"),
        ("first \\boxed{3}, then \\boxed{4}", "4"),  # several boxes: the last
        ("Put it in \\boxed{}. It is \\boxed{7}. Done \\boxed{ }", "7"),  # empty boxes are skipped
        ("\\boxed{3} and then \\boxed{12", "3"),  # a box cut off by the length limit is skipped
        ("\\boxed {5}", "5"),
        ("\\fbox{6}", "6"),
        ("the answer is 46", None),
        ("\\boxed{}", None),
    ],
)
def test_boxed(text, expected):
    assert boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12 + 34 = 46", "46"),
        ("The answer is 46.", "46"),  # a final period is no decimal point
        ("It costs $1,234.50 in total.", "1234.50"),
        ("12 - 34 = -22", "-22"),
        ("so it is -5", "-5"),
        ("10-3", "3"),  # a minus after a number is the operator
        ("12 - 5", "5"),
        ("x-5", "5"),
        ("(2)-3", "3"),
        ("\u22127 degrees", "-7"),  # unicode minus
        ("-$5", "-5"),
        ("1,2,3", "3"),  # a list, not thousands
        ("1,2345", "2345"),
        ("3.5 and 1,000,000", "1000000"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("46", Fraction(46)),
        (" $1,234.50 ", Fraction(2469, 2)),
        ("-15", Fraction(-15)),
        ("$-15.", Fraction(-15)),
        ("46.0", Fraction(46)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{-1}{2}", Fraction(-1, 2)),
        ("1{,}500", Fraction(1500)),
        ("50\\%", Fraction(50)),
        ("\\text{72 apples}", Fraction(72)),
        ("abc", "abc"),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_extract_answer_tries_the_readers_in_order():
    chat = ("boxed", "last_number")
    assert extract_answer("12 + 34 = 46", chat) == "46"  # no box: the last number
    assert extract_answer("\\boxed{46}, not 45", chat) == "46"  # the box wins over a later number
    assert extract_answer("I do not know.", chat) is None
    assert extract_answer("46\nmore 12", ("first_line",)) == "46"
    assert extract_answer("\n46", ("first_line",)) is None  # an empty first line is no answer
    assert extract_answer("a #### 5\n#### 6", ("boxed", "answer_tag", "hashes")) == "6"
    assert extract_answer("<answer>1</answer> <answer> 2 </answer>", ("answer_tag",)) == "2"
    assert extract_answer("<answer></answer>", ("answer_tag", "last_number")) == ""  # found, though empty
    with pytest.raises(ValueError, match="unknown answer reader 'box'"):
        extract_answer("x", ("box",))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so (3 + 5) \\times 2 = 16.", "(3 + 5) * 2"),  # the claimed solution, not the target
        ("I think 3+5 = 8, then 8*2=16", "8*2"),  # the last span with an operator
        ("((3+5)*2 is it", "(3+5)*2"),  # an unmatched parenthesis at the end is dropped
        ("use 7 \u00f7 7 + 1", "7 / 7 + 1"),
        ("no math here, only 16", None),
    ],
)
def test_last_expression(text, expected):
    assert last_expression(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("(3+5)*2", "(3+5)*2"),
        ("(3+5) \\times 2 = 16", "(3+5) * 2"),
        ("16 = 2 \\cdot (5+3)", "2 * (5+3)"),
        ("\\frac{8}{2}+3", "(8)/(2)+3"),
        ("\\left(3+5\\right)\u00d72", "(3+5)*2"),
        ("16", "16"),
    ],
)
def test_clean_expression(text, expected):
    assert clean_expression(text) == expected


def test_last_grid():
    rows = "Here:\n1 2 3 4\n3 4 1 2\n2 1 4 3\n4 3 2 1\n"
    assert last_grid(rows) == "1234341221434321"
    assert last_grid("first 1111222233334444 then 1234|3412|2143|4321.") == "1234341221434321"
    assert last_grid("1234 3412 2143 432") is None  # 15 digits


def test_check_readers_names_the_field():
    assert check_readers(None) is None
    assert check_readers(["boxed", "last_number"]) == ("boxed", "last_number")
    with pytest.raises(ValueError, match=r"extract has unknown reader\(s\) \['boxd'\]"):
        check_readers(["boxd"])
    with pytest.raises(ValueError, match="extract must be a non-empty list"):
        check_readers([])
    with pytest.raises(ValueError, match="extract must be a non-empty list"):
        check_readers("boxed")  # a bare string would be read letter by letter
    assert set(READERS) == {
        "first_line", "boxed", "answer_tag", "hashes", "last_number", "last_expression", "last_grid"
    }  # fmt: skip
