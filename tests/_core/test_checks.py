"""The shared message helper: a received str is quoted (its type shows), a ready-made description is not."""
import pytest

from attnops._core.checks import Described, check_choice, check_int, fail, require
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
