"""Sizes in bytes, written and read in one place (``metrics``): the exact spelling of flags and result keys reads
back to the same number, the rounded one for people keeps the largest unit at 1 or more, and the reader refuses
what is not a size."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opsd_rollout.metrics import bytes_text, parse_size, size_text


@given(st.integers(min_value=1, max_value=2**50))
def test_the_exact_spelling_reads_back_to_the_same_number(count):
    assert parse_size(size_text(count)) == count


def test_the_exact_spelling_takes_the_largest_unit_that_divides():
    assert [size_text(n) for n in (8 * 2**20, 3 * 2**40, 3072, 1536, 2**30 + 2**20)] == \
        ["8MiB", "3TiB", "3KiB", "1536", "1025MiB"]


def test_the_reader_takes_units_in_any_case_and_fractions_of_them():
    assert parse_size("8GiB") == 8 * 2**30 and parse_size(" 1.5gib ") == 3 * 2**29
    assert parse_size("512") == 512 and parse_size(4096) == 4096 and parse_size("2b") == 2


@pytest.mark.parametrize("value", ["0", "0.0001KiB", "-1MiB", "8GB", "MiB", "x", "inf", "nan", True])
def test_the_reader_refuses_what_is_not_a_size_of_at_least_a_byte(value):
    with pytest.raises(ValueError):
        parse_size(value)


def test_the_text_for_people_rounds_in_the_largest_unit_at_one_or_more():
    assert [bytes_text(n) for n in (None, 512, 20684, 5 * 2**20, 3 * 2**29, 1536 * 2**30)] == \
        ["n/a", "512 bytes", "20.2 KiB", "5.0 MiB", "1.5 GiB", "1.5 TiB"]
    assert bytes_text(2**40 - 1) == "1,024.0 GiB"  # rounded up, still in the unit it is under
