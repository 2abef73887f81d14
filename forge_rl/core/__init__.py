"""What every other package builds on: the records passed between components, the config, the loss,
the app contract. Imports nothing of forge_rl above it."""
