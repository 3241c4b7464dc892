"""A result file that is no result file is named as such: even JSON nested far deeper than the recursion limit
(issue 49, round-4 leftover), which json's decoder would turn into a raw RecursionError."""
from __future__ import annotations

import pytest

from ddp_helpers.engine.result import TrainResult


@pytest.mark.parametrize("depth", [10**5, 10**6])
def test_deeply_nested_json_is_named(tmp_path, depth):
    path = tmp_path / "result.json"
    path.write_text("[" * depth + "]" * depth)
    with pytest.raises(ValueError, match=r"is not a result file: its JSON nests deeper than Python's recursion "
                                         r"limit") as e:
        TrainResult.load(str(path))
    assert str(path) in str(e.value) and e.value.__cause__ is None
