"""`python -m forge_rl.grpo --config FILE [dotted.key=value ...]`: train with GRPO (forge_rl/recipes/grpo/).

    python -m forge_rl.grpo --config configs/blackjack_tiny_cpu.yaml trainer.optimizer.lr=2e-4

Bad input stops before anything starts, with one line and status 2; every process's output goes to
run_dir/run.log, the console keeps the progress bar, the evaluation lines and warnings. The command line
is read before the stack is imported (seconds), so --help and a bad key answer at once.
"""

WHAT = "Train with GRPO: the config's app, environment and model (configs/blackjack_tiny_cpu.yaml: BlackJack, tiny model, CPU)."

if __name__ == "__main__":
    from forge_rl.core.config import parse_cli
    from forge_rl.core.config.loading import exit_on_help

    exit_on_help("forge_rl.grpo", WHAT)
    config = parse_cli()
    from forge_rl.recipes.grpo.main import run_from_command_line

    run_from_command_line(config)
