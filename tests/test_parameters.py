"""Triton's request parameters (and the repository index's body), decoded once for HTTP
and gRPC: each wrong value is refused naming the parameter, what it expected and what
came, in the same words for every flag."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servekit.errors import InvalidInput
from servekit.protocol.parameters import flag, scheduling, sequence_flags
from servekit.protocol.surface import ready_only_asked

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=5,
)


@given(value=json_values, key=st.sampled_from(["binary_data_output", "sequence_end"]))
def test_a_flag_is_only_true_or_false_and_anything_else_is_named(value, key):
    if type(value) is bool:
        assert flag({key: value}, key) is value
    else:
        with pytest.raises(InvalidInput) as refused:
            flag({key: value}, key, "request")
        assert str(refused.value) == (
            f"request: parameter {key!r}: expected true or false, got {value!r}"
        )
    assert flag({}, key) is False


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        ({"sequence_id": 1, "sequence_start": 1}, "parameter 'sequence_start': expected true or "
         "false, got 1"),
        ({"sequence_id": 1, "sequence_end": "yes"}, "parameter 'sequence_end': expected true or "
         "false, got 'yes'"),
        ({"sequence_id": -3}, "parameter 'sequence_id': expected a non-negative integer or a "
         "string, got -3"),
        ({"sequence_id": True}, "parameter 'sequence_id': expected a non-negative integer or a "
         "string, got True"),
        ({"sequence_id": 2.5}, "got 2.5"),
    ],
)  # fmt: skip
def test_sequence_parameters_of_the_wrong_kind_are_refused_by_name(parameters, says):
    with pytest.raises(InvalidInput, match=re.escape(says)):
        sequence_flags(parameters)


def test_sequence_parameters_as_clients_send_them():
    assert sequence_flags({"priority": 1}) is None
    flags = sequence_flags({"sequence_id": "a", "sequence_start": True})
    assert (flags.id, flags.start, flags.end) == ("a", True, False)
    flags = sequence_flags({"sequence_id": 7, "sequence_end": True})
    assert (flags.id, flags.start, flags.end) == (7, False, True)


@pytest.mark.parametrize("key", ["priority", "timeout"])
@pytest.mark.parametrize("value", [-1, 1.5, "3", True, None])
def test_priority_and_timeout_are_non_negative_integers(key, value):
    with pytest.raises(InvalidInput, match=f"parameter '{key}': expected a non-negative integer"):
        scheduling({key: value})


def test_priority_and_timeout_become_the_batchers_keywords():
    assert scheduling({"priority": 2, "timeout": 500, "other": "x"}) == {
        "priority": 2,
        "timeout_us": 500,
    }
    assert scheduling({}) == {}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"ready": 1}', "repository index request: 'ready': expected true or false, got 1"),
        (b'{"ready": "yes"}', "'ready': expected true or false, got 'yes'"),
        (b"[true]", "repository index request: expected a JSON object, got list"),
        (b"{", "repository index request"),
    ],
)
def test_a_repository_index_body_that_is_not_ready_true_or_false_is_refused(body, says):
    with pytest.raises(InvalidInput, match=re.escape(says)):
        ready_only_asked(body)


def test_a_repository_index_body_asks_for_ready_models_or_all():
    assert ready_only_asked(b'{"ready": true}') is True
    assert ready_only_asked(b'{"ready": false}') is ready_only_asked(b"{}") is False
    assert ready_only_asked(b"  ") is False
