"""``python -m attnops check`` has a row for every flash-attn function (flash-attn 2's and FA3's names), on the
reference and Triton; one row runs and passes."""
from attnops import check, flash_attn
from attnops.check import flash_attn as flash_attn_check


def test_every_function_has_a_check_row():
    operators = {c.operator for c in check.all_cases() if "triton" in c.backends}
    names = {f"attnops.flash_attn.{n}" for n in flash_attn.__all__
             if n.startswith("flash_attn_") and callable(getattr(flash_attn, n))}
    # FA3's split merge and scheduling helper compute no attention (tests/flash_attn/test_fa3_features.py has them)
    helpers = {"flash_attn_combine", "get_scheduler_metadata"}
    names |= {f"attnops.flash_attn.fa3.{n}" for n in flash_attn.fa3.__all__ if n not in helpers}
    assert names <= operators, names - operators


def test_a_row_passes_on_the_reference():
    case = next(c for c in flash_attn_check.cases() if c.operator.endswith(".fa3.flash_attn_varlen_func"))
    row = check.run_case(case, "reference")
    assert row.ok, row.detail
