# Set-up is automatic: every target creates .venv and installs what it needs.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
MODEL   ?= examples/tiny-llama
OUT     ?= out/tiny-llama-moe
EVAL_TOKENS ?= 8192
# pytest-xdist workers: one more than the cores, as many tests wait on subprocesses, timeouts and the disk
TEST_WORKERS ?= $(shell $(PY) -c 'import os; print((os.cpu_count() or 1) + 1)')

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

CALIB   ?= examples/calib/wikitext2_train_sample.txt

# Weight-only carving (gate-cluster + representative router), then the calibrated default
# (activation partition + fitted router + down_proj refit), both compared with the dense model.
demo: $(STAMP)
	$(BIN)/moeify convert $(MODEL) $(OUT)-weights --experts 8 --top-k 2 --weight-only --overwrite
	$(BIN)/moeify convert $(MODEL) $(OUT) --experts 8 --top-k 2 --calib $(CALIB) --calib-tokens 16384 --overwrite
	$(BIN)/moeify eval $(MODEL) $(OUT)-weights $(OUT) --seq-len 256 --max-tokens $(EVAL_TOKENS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15

clean:
	rm -rf out .pytest_cache
