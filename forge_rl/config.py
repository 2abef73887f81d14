"""`python -m forge_rl.config --config FILE [dotted.key=value ...]`: check a config and print it resolved,
starting nothing. Bad input: one line on stderr, exit status 2."""

from forge_rl.core.config import parse_cli, to_yaml

if __name__ == "__main__":
    print(to_yaml(parse_cli()), end="")
