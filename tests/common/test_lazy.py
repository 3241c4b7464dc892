"""The lazy exports: a name imported from its module on first use, from another package's modules, or renamed."""
from __future__ import annotations

import pytest

from ddp_helpers.common import errors
from ddp_helpers.common.lazy import lazy_exports


def test_a_name_comes_from_its_module_relative_to_base_and_may_be_renamed():
    namespace: dict = {}
    getattr_, dir_ = lazy_exports("ddp_helpers.lesson", {"one_line": "common.errors",
                                                          "Refusal": "common.errors:ConfigError"},
                                  namespace, base="ddp_helpers")
    assert getattr_("one_line") is errors.one_line
    assert getattr_("Refusal") is errors.ConfigError  # "module:name": that module's name, under another
    assert namespace == {"one_line": errors.one_line, "Refusal": errors.ConfigError}  # later lookups skip getattr
    assert dir_() == ["Refusal", "one_line"]


def test_a_name_not_in_the_table_is_an_attribute_error():
    getattr_, _ = lazy_exports("ddp_helpers.lesson", {"one_line": "common.errors"}, {}, base="ddp_helpers")
    with pytest.raises(AttributeError, match="'ddp_helpers.lesson' has no attribute 'errors'"):
        getattr_("errors")
