# Set-up is automatic: every target creates .venv and installs what it needs.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
MODEL   ?= examples/tiny-llama
OUT     ?= out/tiny-llama-moe
EVAL_TOKENS ?= 8192

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/moeify convert $(MODEL) $(OUT) --experts 8 --top-k 2 --overwrite
	$(BIN)/moeify eval $(MODEL) $(OUT) --seq-len 256 --max-tokens $(EVAL_TOKENS)

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf out .pytest_cache
