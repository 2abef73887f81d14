"""What every section's `check` raises, and the checks most of them share."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad configuration; the message is one line naming the key, the file and what was expected."""


def check_positive(section, key, *names):
    for name in names:
        if getattr(section, name) <= 0:
            raise ConfigError(f"{key}.{name}: expected > 0, got {getattr(section, name)}")


def check_mapping(section, key, name):
    value = getattr(section, name)
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{key}.{name}: expected a mapping of argument names to values, got {value!r}")


def check_non_negative(section, key, *names):
    for name in names:
        if getattr(section, name) < 0:
            raise ConfigError(f"{key}.{name}: expected >= 0, got {getattr(section, name)}")
