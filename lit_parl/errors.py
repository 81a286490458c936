"""The error every on-policy check raises."""


class OffPolicyError(RuntimeError):
    """Data or a request of another policy version than the iteration's."""
