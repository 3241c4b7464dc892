"""tools/follow_calls.py counts stops, rooms and returns as its docstring says."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("follow_calls", Path(__file__).parents[2] / "tools" / "follow_calls.py")
follow_calls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(follow_calls)


def test_a_function_counts_once_and_a_room_again_is_a_return():
    events = [("a.py", "f", 0), ("a.py", "g", 1), ("b.py", "h", 2), ("a.py", "g", 1), ("a.py", "k", 1),
              ("c.py", "deep", 3)]
    assert follow_calls.stops(events, 10) == [("a.py", ["f", "g"]), ("b.py", ["h"]), ("a.py", ["k"]),
                                              ("c.py", ["deep"])]
    assert follow_calls.stops(events, 2) == [("a.py", ["f", "g"]), ("b.py", ["h"]), ("a.py", ["k"])]


def test_the_trace_keeps_the_package_and_its_depth(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("def inner():\n    return 1\n\ndef outer():\n    return inner() + len('x')\n")
    spec = importlib.util.spec_from_file_location("m", pkg / "m.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    assert follow_calls.trace(m.outer, str(pkg)) == [("m.py", "outer", 0), ("m.py", "inner", 1)]
