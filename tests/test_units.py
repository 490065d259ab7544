import pytest

from dpprof.units import fmt_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * 2**30), ("40GB", 40 * 10**9), ("24G", 24 * 2**30), ("512MiB", 2**29),
     ("1.5 GiB", int(1.5 * 2**30)), ("1000", 1000)],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "eighty", "80XB", "-5GiB", "0GiB", "GiB"])
def test_parse_bytes_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match=r"GiB|zero"):
        parse_bytes(bad)


def test_fmt_bytes() -> None:
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(1536) == "1.50 KiB"
    assert fmt_bytes(55 * 2**30) == "55.0 GiB"
    assert fmt_bytes(-2**20, signed=True) == "-1.00 MiB"
    assert fmt_bytes(2**20, signed=True) == "+1.00 MiB"
    assert fmt_bytes(None) == "n/a"
