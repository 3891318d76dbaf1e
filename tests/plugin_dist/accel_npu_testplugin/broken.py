"""A plugin whose import raises: it must be reported by name and skipped, never break torch."""

raise RuntimeError("this plugin is broken on purpose")
