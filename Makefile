# The two quick-start commands: `make demo` (train DP-SGD on the bundled digits) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1

.PHONY: install demo test test-fast test-isa wheel-check lint docs format clean

$(BIN)/lightning-dp: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,docs]"
	touch $@

install: $(BIN)/lightning-dp

demo: install
	$(BIN)/lightning-dp fit --config configs/digits_dpsgd.yaml

# Two workers (CI has 2 cores); --dist loadfile keeps each file on one worker, so a module-scoped fixture
# (a DDP or fault-injection run) runs once and a file's tests keep their order. The 15 slowest are listed.
XDIST := -n 2 --dist loadfile
# -rs names every skipped test and why (data sets the clone does not carry: tests/conftest.py's requires_data).
test: install lint
	$(BIN)/python -m pytest tests $(XDIST) -rs --durations=15

# The fast-clipping exactness tests again with narrower CPU kernels (ATen, MKL, oneDNN): on an AVX-512
# machine `make test` runs the native ones, these the AVX2 and plain paths (about 10 s each on 2 workers).
ISA_TESTS := tests/per_example/test_kernels.py tests/per_example/test_kernels_conv.py tests/per_example/test_kernels_linear.py tests/per_example/test_kernels_embedding.py tests/per_example/test_kernels_tied.py tests/per_example/test_kernels_conv_sums.py tests/per_example/test_kernels_scale.py tests/per_example/test_materialized.py tests/per_example/test_certified.py -k "not random_shapes and not private_step"
test-isa: install
	ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 $(BIN)/python -m pytest $(ISA_TESTS) -n 2
	ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 $(BIN)/python -m pytest $(ISA_TESTS) -n 2

test-fast: install
	$(BIN)/python -m pytest tests $(XDIST) -m "not slow"

# The wheel installed into a fresh virtualenv outside the clone (README: install into your own project).
wheel-check: install
	PYTHON=$(BIN)/python .ci/wheel_check.sh

lint: install
	$(BIN)/ruff check lightning_dp recipes tests bench
	$(BIN)/ruff format --check lightning_dp recipes tests bench
	$(BIN)/mypy

# The documentation site (mkdocs.yml: docs/ and the API reference from the docstrings) into site/.
# --strict: a broken link, a missing page or an API reference that does not resolve fails the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

format: install
	$(BIN)/ruff format lightning_dp recipes tests bench
	$(BIN)/ruff check --fix lightning_dp recipes tests bench

clean:
	rm -rf $(VENV) lightning_logs runs site .pytest_cache .mypy_cache .ruff_cache
