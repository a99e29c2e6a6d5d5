"""Errors that mean "the input is wrong": tools print them as one line and exit non-zero."""


class ArmkvError(ValueError):
    """Bad input (config, adapter, checkpoint, prompt, method name). The message says what to change."""
