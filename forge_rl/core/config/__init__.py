"""The run's configuration: the schema (schema.py) and how a YAML file becomes a checked instance of it
(loading.py). Every name a caller needs is importable from here."""

from forge_rl.core.config.loading import dump, load_config, parse_cli, to_yaml
from forge_rl.core.config.schema import *  # noqa: F401, F403
from forge_rl.core.config.schema import ConfigError, RunConfig

__all__ = ["ConfigError", "RunConfig", "load_config", "parse_cli", "to_yaml", "dump"]
