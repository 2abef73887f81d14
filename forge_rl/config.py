"""`python -m forge_rl.config --config FILE [dotted.key=value ...]`: check a config as a run checks it at start
(the schema, then recipes/grpo/check.py), starting nothing, and print it resolved. Bad input: one line on
stderr, exit status 2."""

WHAT = """Check a config as a run does before it starts anything, and print it resolved: the keys and values, app_module
and what it provides, env.server (imports) or env.url (a URL), model.path (resolves; a hub id is not
downloaded), the tiny model's words for the app's prompt and answers, logging.wandb_project's package and key,
and the GPUs a local run places."""

if __name__ == "__main__":
    import sys

    from forge_rl.core.config import ConfigError, parse_cli, to_yaml
    from forge_rl.core.config.loading import exit_on_help

    exit_on_help("forge_rl.config", WHAT)
    config = parse_cli()
    from forge_rl.recipes.grpo.check import check_run

    try:
        check_run(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(to_yaml(config), end="")
