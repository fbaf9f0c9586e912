# agentloop: `make demo` runs a rollout on a tiny local model; `make test` runs the test suite.
# Both create .venv and install what they need. EXTRA=gpu installs the CUDA engine instead.
PYTHON ?= python3
VENV ?= .venv
EXTRA ?= cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.agentloop-$(EXTRA)-installed

export RAY_AUTH_MODE ?= disabled
export VLLM_CPU_KVCACHE_SPACE ?= 1
export RAY_DEDUP_LOGS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install model demo grpo trl-grpo test test-unit lint bench clean verifiers-env openenv-env

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRA),dev]"
	# PyPI's torchvision/torchaudio/torchcodec are CUDA-linked and break transformers next to the CPU torch.
	if [ "$(EXTRA)" = "cpu" ]; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	touch $@

install: $(STAMP)

# verifiers 0.4.0 in its own venv (its openai 2.x / mcp 2.0 pins clash with the engine's): the verifiers environments
# (docs/environments.md#verifiers) run their episodes there, out of process. ~1 min; needs Python >= 3.11.
VF_VENV ?= .venv-verifiers
VF_STAMP := $(VF_VENV)/.verifiers-0.4.0-installed

$(VF_STAMP):
	test -x $(VF_VENV)/bin/python || $(PYTHON) -m venv $(VF_VENV)
	$(VF_VENV)/bin/python -m pip install -q --upgrade pip
	$(VF_VENV)/bin/python -m pip install -q verifiers==0.4.0
	touch $@

verifiers-env: $(VF_STAMP)

# openenv 0.10.0 in its own venv (it needs fastmcp<4 -> mcp<2 and gradio -> pillow<13, the engine has mcp 2.x and
# pillow 13): the OpenEnv environments (docs/environments.md#openenv) run their client and server there, out of
# process. ~1.5 min; needs Python >= 3.11.
OE_VENV ?= .venv-openenv
OE_STAMP := $(OE_VENV)/.openenv-0.10.0-installed

$(OE_STAMP):
	test -x $(OE_VENV)/bin/python || $(PYTHON) -m venv $(OE_VENV)
	$(OE_VENV)/bin/python -m pip install -q --upgrade pip
	$(OE_VENV)/bin/python -m pip install -q openenv==0.10.0 uvicorn
	touch $@

openenv-env: $(OE_STAMP)

# Installs the tiny tool-calling model shipped in agentloop/assets into the cache (no training; `python
# scripts/make_tiny_model.py --force` retrains it, ~4-6 min on 2 cores, and compares it with the shipped one).
model: install
	$(PY) scripts/make_tiny_model.py

demo: install
	$(VENV)/bin/agentloop rollout --config examples/quickstart/config.yaml \
	  actor_rollout_ref.model.path=$$($(PY) scripts/make_tiny_model.py --quiet)

# GRPO on the calculator task (examples/grpo_calculator): ~4-5 min on 2 idle cores (its weaker starting checkpoint
# ships in agentloop/assets); 60 steps, greedy held-out success +0.195 / +0.203 / +0.188 for seeds 0 / 1 / 2
# (SEED=n picks another). Prints the seed and the reward per step; writes outputs/grpo_calculator/reward_curve.png.
grpo: install
	$(PY) examples/grpo_calculator/train.py --seed $(SEED)

# TRL's GRPOTrainer with agentloop as its rollout backend (examples/trl_grpo_calculator; docs/trl.md): the same task,
# 60 rollouts at lr 1e-4, ~8-12 min on 2 shared cores; greedy success on 256 fixed held-out problems +0.176 / +0.199 / +0.168
# for seeds 0 / 1 / 2. SEED=1 picks another seed; BACKEND=trl uses TRL's own generation and tool loop instead.
SEED ?= 0
BACKEND ?= agentloop
trl-grpo: install
	$(PY) examples/trl_grpo_calculator/train.py --seed $(SEED) --backend $(BACKEND)

test: install model verifiers-env openenv-env
	$(PY) -m pytest tests -q -p no:cacheprovider --durations=25

test-unit: install
	$(PY) -m pytest tests/unit -q

lint: install
	$(VENV)/bin/ruff check agentloop tests scripts
	$(VENV)/bin/mypy agentloop
	$(PY) scripts/check_structure.py

bench: install
	$(PY) scripts/bench_overhead.py

clean:
	rm -rf outputs .pytest_cache
