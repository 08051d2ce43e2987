"""ConfigError: the one exception for a bad configuration.

Owns: the exception type every component raises for a setting it cannot take.
Never: import anything (the schema, the command line and every component's checks
raise it). Cost: none.
"""


class ConfigError(ValueError):
    """A bad configuration; the message is one line naming the key, the value and the fix."""
