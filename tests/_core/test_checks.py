"""The shared message helper: a received str is quoted (its type shows), a ready-made description is not."""
import pytest

from attnops._core.checks import Described, caller_names, check_choice, check_int, fail, require
from attnops._core.errors import ParamDtypeError, ParamInvalidError


def test_a_received_str_is_shown_with_repr():
    with pytest.raises(ParamInvalidError, match=r"^causal: expected a bool, got 'False'$"):
        require(False, "causal", "a bool", "False")
    with pytest.raises(ParamDtypeError, match=r"^head_num: expected an int, got '4'$"):
        check_int("head_num", "4")
    with pytest.raises(ParamInvalidError, match=r"^layout: expected one of \['BSND', 'TND'\], got 'bsnd'$"):
        check_choice("layout", "bsnd", ["BSND", "TND"])


def test_a_described_value_is_shown_as_it_is():
    with pytest.raises(ParamInvalidError, match=r"^key: expected D=8, got D=4\. hint$"):
        fail("key", "D=8", Described("D=4"), "hint")


def test_caller_names_rename_the_argument_and_its_references():
    with pytest.raises(ParamInvalidError, match=r"^v: expected 2 heads like k \(same as q\), got 'x'\. hint$"):
        with caller_names({"query": "q", "key": "k", "value": "v"}):
            fail("value", "2 heads like key (same as query)", "x", "hint")
    with pytest.raises(ParamInvalidError, match=r"^scale: expected a value like key, got 1$"):  # not renamed
        with caller_names({"key": "k"}):
            fail("scale", "a value like key", 1)


def test_caller_names_rename_an_element_of_the_argument():
    with pytest.raises(ParamInvalidError, match=r"^seq_lens\[1\]: expected a length in \[0, 4\], got -7$"):
        with caller_names(actual_seq_kvlen="seq_lens"):
            fail("actual_seq_kvlen[1]", "a length in [0, 4]", -7)
