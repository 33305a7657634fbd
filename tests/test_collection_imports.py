"""Collection imports no slow library: every xdist worker collects the whole suite, so a module-level import that
takes seconds (transformers' modeling drags in sympy and torchvision; the model API SDKs; Megatron, SGLang, Ray) is
paid once per worker in every run. Tests that need one import it inside the test or fixture; src modules that only
some callers need it for import it where it is used (gyre_train.backends.torch_backend loads transformers in
TorchBackend). What a collection imported is recorded by tests/conftest.py; this checks the session's own
collection, so it guards the whole suite where the whole suite is collected (CI, `pytest -n 2`).

To find who imports one: `python -X importtime -m pytest --collect-only -q -s` prints each import under the one
that caused it (-s, or pytest captures the report)."""

# torch stays: many test modules use it at module level (parametrize values, skipif conditions, helpers).
SLOW = ("transformers", "anthropic", "openai", "sympy", "torchvision", "megatron", "sglang", "ray")


def test_collection_imported_no_slow_library(collected_modules):
    found = sorted({name.split(".")[0] for name in collected_modules} & set(SLOW))
    assert found == [], f"collecting the tests imported {found}: import them inside the tests that use them"
