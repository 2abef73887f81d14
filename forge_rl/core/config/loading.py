"""Reading a config: OmegaConf for files, interpolation and dotted overrides; the schema's dataclasses for checking.

Conversion rejects unknown keys, missing required keys, wrong types and impossible values with one line that
names the key and the file, before anything is launched.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from pathlib import Path
from typing import Literal

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from forge_rl.core.config.schema import ConfigError, RunConfig
from forge_rl.core.errors import first_line


def load_config(path: str | Path, overrides: list[str] = (), schema: type = RunConfig):
    """Read `path`, apply dotted `overrides`, resolve interpolation, return a checked `schema` instance."""
    path = Path(path)
    where = f"in {path}" + (" (with overrides)" if overrides else "")
    try:
        raw = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.MarkedYAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e, path)}") from None
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not valid YAML: {first_line(e)}") from None
    try:
        merged = OmegaConf.merge(raw, OmegaConf.from_dotlist(list(overrides)))
        _command_line_env_wins(merged, raw, overrides, path)
        data = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"{key}: {first_line(e)} {where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    given = frozenset(_dotted_keys(data))
    fitted = _fit_defaults(data, given, getattr(schema, "FITTED_DEFAULTS", {}))
    try:
        cfg = _to_dataclass(schema, data, "")
    except ConfigError as e:
        raise ConfigError(f"{e} {where}") from None
    cfg.keys_given, cfg.defaults_fitted = given, fitted
    return cfg


def _fit_defaults(data: dict, given: frozenset, table: dict) -> dict[str, dict]:
    """Into `data`, the defaults of each kind of config it is (table: kind -> (the section.key whose being set makes
    it one, {key: default})), for the keys it did not give; returns kind -> {key: default} of those taken."""
    fitted = {}
    for kind, (when, defaults) in table.items():
        head, name = when.split(".")
        if not isinstance(data.get(head), dict) or data[head].get(name) is None:
            continue
        for key, value in defaults.items():
            *parents, name = key.split(".")
            section = data
            for part in parents:
                section = section.setdefault(part, {})
            if key not in given and isinstance(section, dict):  # else the schema names what is wrong with it
                section[name] = fitted.setdefault(kind, {})[key] = value
    return fitted


def _dotted_keys(data: dict, prefix: str = "") -> list[str]:
    """Every key of a nested mapping, dotted: {trainer: {lora: null}} -> trainer, trainer.lora."""
    keys = []
    for name, value in data.items():
        keys.append(prefix + str(name))
        if isinstance(value, dict):
            keys += _dotted_keys(value, f"{prefix}{name}.")
    return keys


def _yaml_problem(e: yaml.MarkedYAMLError, path: Path) -> str:
    """PyYAML's error in one line that keeps where and what: 'line 7, column 1: found duplicate key seed
    (while constructing a mapping at line 1, column 1)'; a tab, which YAML never accepts as indentation,
    is named as such."""
    mark = e.problem_mark or e.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    problem = " ".join((e.problem or e.context or str(e)).split())
    if mark is not None:
        lines = path.read_text(errors="replace").splitlines()
        if mark.line < len(lines) and lines[mark.line][mark.column : mark.column + 1] == "\t":
            problem += " (a tab: YAML indents with spaces)"
    if e.context and e.problem and e.context_mark is not None and (e.context_mark.line, e.context_mark.column) != (mark.line, mark.column):
        problem += f" ({e.context} at line {e.context_mark.line + 1}, column {e.context_mark.column + 1})"
    return where + problem


def _command_line_env_wins(merged, raw, overrides, path) -> None:
    """env.url given on the command line over a file that names env.server: the running server is meant
    (a local config pointed at a deployed server), so the file's env.server is dropped rather than
    stopping on "set exactly one". The other way round (env.server over a file's env.url) is refused with
    the fix, as a launched server instead of the configured one is seldom what was meant."""
    keys = {o.split("=", 1)[0].strip().lstrip("+") for o in overrides}
    if "env.url" in keys and "env.server" not in keys and OmegaConf.select(merged, "env.url") is not None:
        merged.env.server = None
    file_url = OmegaConf.select(raw, "env.url", default=None)
    if "env.server" in keys and "env.url" not in keys and file_url is not None and OmegaConf.select(merged, "env.server") is not None:
        raise ConfigError(f"env.server: given on the command line, but {path} sets env.url {file_url}: add env.url=null")


USAGE = """usage: python -m {prog} --config FILE [dotted.key=value ...]

{what}

Any key of the config can be overridden on the command line, e.g. grpo.group_size=16 trainer.optimizer.lr=2e-4.
The keys: docs/configuration.md, and the comments in configs/*.yaml (configs/blackjack_tiny_cpu.yaml is `make train`'s).
Bad input stops with one line, `config error: <key>: ...`, and exit status 2."""


def exit_on_help(prog: str, what: str) -> None:
    """-h or --help on the command line: the usage, exit status 0 (before the stack is imported)."""
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(USAGE.format(prog=prog, what=what))
        raise SystemExit(0)


def parse_cli(argv: list[str] | None = None, schema: type = RunConfig):
    """`--config FILE [key=value ...]` -> checked config. Bad input: one line on stderr, exit status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" not in argv or argv.index("--config") + 1 >= len(argv):
        _exit_with("usage: --config FILE [dotted.key=value ...] (--help: where the keys are documented)")
    i = argv.index("--config")
    path, overrides = argv[i + 1], argv[:i] + argv[i + 2 :]
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        _exit_with(f"override {bad[0]!r} is not of the form dotted.key=value")
    try:
        return load_config(path, overrides, schema)
    except ConfigError as e:
        _exit_with(f"config error: {e}")


def to_yaml(cfg) -> str:
    """The resolved config as YAML, saved beside a run's logs so it can be reproduced."""
    return OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg)))


def _exit_with(message: str):
    print(message, file=sys.stderr)
    raise SystemExit(2)


def _to_dataclass(cls, data: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    retired = getattr(cls, "RETIRED_KEYS", {})
    for name in data:
        if name in retired:
            raise ConfigError(f"{prefix}{name}: {retired[name]}")
        if name not in fields:
            nearest = difflib.get_close_matches(str(name), fields, n=1)
            hint = f"did you mean {prefix}{nearest[0]}?" if nearest else f"known: {', '.join(fields)}"
            raise ConfigError(f"{prefix}{name}: unknown key ({hint})")
    values = {}
    for name, f in fields.items():
        key = prefix + name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{key}: missing required key")
            continue
        values[name] = _convert(hints[name], data[name], key)
    obj = cls(**values)
    if hasattr(obj, "check"):
        obj.check(prefix.rstrip(".") or cls.__name__)
    return obj


def _convert(tp, value, key: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        listed = [a for a in inner if typing.get_origin(a) is list]
        if len(inner) > 1 and listed:  # a value or a list of values (eval.task_split): which one it is
            inner = listed if isinstance(value, list) else [a for a in inner if a not in listed]
        (inner,) = inner
        return _convert(inner, value, key)
    if origin is Literal:
        if value is False and "off" in args:  # YAML 1.1 reads a bare `off` as false
            value = "off"
        if value not in args:
            raise ConfigError(f"{key}: expected one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a section (mapping), got {value!r}")
        return _to_dataclass(tp, value, key + ".")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    return value


def dump(cfg, path: Path) -> None:
    """Write the resolved config to `path` (creating its folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg))
