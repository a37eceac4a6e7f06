"""Fields routers add when they re-serialize a request (vllm-router, sglang-router): accepted at
the values that ask for what atom does anyway, refused otherwise."""

import pytest
from pydantic import ValidationError

from atom.serve.protocol import CompletionRequest

ROUTER_DEFAULTS = {
    "skip_special_tokens": True,
    "no_stop_trim": False,
    "return_hidden_states": False,
}


def test_router_defaults_are_accepted():
    req = CompletionRequest(model="m", prompt="hi", **ROUTER_DEFAULTS)
    assert req.prompt == "hi"


@pytest.mark.parametrize(
    "field, value",
    [("skip_special_tokens", False), ("no_stop_trim", True), ("return_hidden_states", True)],
)
def test_asking_for_something_else_is_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        CompletionRequest(model="m", prompt="hi", **{field: value})
