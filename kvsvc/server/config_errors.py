"""The configuration's errors, apart from :mod:`kvsvc.server.config` so that the modules
it builds on (:mod:`kvsvc.server.kv_events_targets`) raise them too."""


class ConfigError(ValueError):
    """A server or pool setting is invalid; the message names it."""


class ConfigFileError(ConfigError):
    """A file a setting names cannot be used (missing, unreadable, wrong content): the
    environment is wrong rather than the settings (``kvsvc serve`` exits 1, not 2)."""
