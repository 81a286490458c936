"""The errors lit_parl raises for what a check found, beyond a bad argument's ValueError."""


class OffPolicyError(RuntimeError):
    """Data or a request of another policy version than the iteration's."""


class PoolStartError(RuntimeError):
    """The rollout pool could not start what its settings name (a server that does not answer or exits while
    starting): the message says which, and where to look; the CLI prints it without a traceback."""


class EndpointError(RuntimeError):
    """A server the run talks to (an LLM judge's) cannot be reached or keeps failing: the message names it and
    what to check; the CLI prints it without a traceback."""
