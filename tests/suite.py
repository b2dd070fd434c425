"""What the test suite runs on: SmolLM2-135M, for speed (the default preset has its own
real-model tests). `tests/conftest.py` puts it into the session's environment; a test that
loads settings from an environment of its own adds `SUITE_ENV`."""

SUITE_ENV = {
    "SELFRAG_MODEL__PRESET": "smollm2",
    # `selfrag ask` would calibrate first (minutes); tests that want it turn it on.
    "SELFRAG_MODEL__CALIBRATE_ON_FIRST_USE": "false",
}
