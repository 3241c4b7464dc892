# Two commands on a fresh machine:  make demo  (train 2 ranks offline, write result + plots)  and  make test.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed-$(shell cat pyproject.toml requirements-recorded.txt | cksum | cut -d' ' -f1)
OUT    ?= runs/demo

.PHONY: env demo test test-unit test-notebooks test-floor test-ceiling test-browser solutions assignment grade bench bench-allreduce bench-startup bench-launch bench-threads bench-warmth bench-restart faults lab notebooks site clean

env: $(STAMP)

# One virtual environment with the package (editable) and the test tools, on the torch the notebooks were recorded
# with (-c requirements-recorded.txt: what nbval compares against); re-done when either file changes. pip runs
# through tools/pip_progress.py: it says what it downloads and how much first, then lists each package it fetches
# and, every 15 s pip is otherwise quiet, what it is doing and how much so far: the file being fetched and its bytes
# (pip's --progress-bar raw), or the bytes written into the venv (the whole output goes to $(VENV)/install.log).
# First the interpreter against requires-python (the venv's own if there is one), so an old Python fails in one line.
FLOOR = $(shell sed -n 's/^requires-python = ">=\([0-9.]*\)".*/\1/p' pyproject.toml)
$(STAMP): pyproject.toml requirements-recorded.txt
	@$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -c 'import sys; v = sys.version_info[:2]; sys.exit(v < tuple(map(int, "$(FLOOR)".split("."))) and f"make env: {sys.executable} is Python {v[0]}.{v[1]}; the package, its tests and nbgrader 0.9.6 (the teacher extra) need Python >= $(FLOOR). Give one: make PYTHON=python$(FLOOR) demo (remove $(VENV) first if it holds the old one)")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# setuptools>=77 (build-system.requires) into the venv itself: tools/pip_user.py builds the wheel offline with it
	@# (--no-build-isolation), and a new venv has none (3.12+) or an older one (3.11: 65.5, which rejects the license).
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" > $(VENV)/install.log 2>&1 || (tail -20 $(VENV)/install.log; exit 1)
	$(PY) tools/pip_progress.py $(VENV)/install.log -- install -e ".[test,teacher,vision]" -c requirements-recorded.txt
	@# nbgrader (the teacher extra, which the tests need) stays out of JupyterLab: make lab shows the learner's Lab.
	$(VENV)/bin/jupyter labextension disable --level=sys_prefix @jupyter/nbgrader > /dev/null 2>&1 || true
	@for e in formgrader validate_assignment assignment_list course_list; do \
	    $(VENV)/bin/jupyter server extension disable --sys-prefix nbgrader.server_extensions.$$e > /dev/null 2>&1 || true; done
	$(PY) -m ipykernel install --sys-prefix --name python3 > /dev/null
	rm -f $(VENV)/.installed-* && touch $@

# The main job: the tutorial's 2-process DDP training on the offline default data, with its plots.
demo: env
	$(PY) -m ddp_helpers.train --out $(OUT)
	@echo "open $(OUT)/loss.png, $(OUT)/grad_norms.png, $(OUT)/fingerprints.png"

# The notebooks that print numeric comparisons (by hand vs DDP, DDP vs one process, accumulation, fp16), compared
# with other CPU kernels: torch's without SIMD (ATEN_CPU_CAPABILITY=default) and MKL's vendor-neutral
# ones (MKL_CBWR=COMPATIBLE). The last bits of float32 sums change with them, as on another CPU; the stored
# outputs must not (notebooks/README.md says how they avoid it). Paths inside notebooks/. Notebook 00 is not
# among them (issue 52: each proof once): what it computes with floats repeats these notebooks' cells, its
# gradients 03's Cell 2, its worked steps against DDP 03b's Cells 3-4, its run of examples/ddp_mnist.py 04's Cell 2.
OTHER_KERNELS = ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE
NUMERIC_NBS   = 03_ddp_gradient_sync.ipynb 03b_build_ddp_sync.ipynb 04_two_process_mnist.ipynb 05_beyond_the_basics.ipynb

# Every test: unit and process tests; the executed notebooks compared by nbval as a pip user gets them
# (tools/pip_user.py: the wheel installed outside the repository, the notebooks copied out by its console script),
# the numeric ones as copies whose kernels get OTHER_KERNELS (only the kernels and what they start:
# tools/nbval_ipc.py), and only so (--only-again, issue 52: each proof once): their outputs were recorded with the
# recording machine's own kernels, so a run under other kernels is the one that can find an output that depends
# on the CPU; a run with the kernels they were recorded with adds nothing it doesn't check too. Each part on two
# pytest-xdist workers (XDIST=-n0: one process): whole test files to each (tests/conftest.py), whole notebooks to
# each, longest first (--dist loadfile: a notebook's cells share one kernel). More workers than cores make the
# timing bounds of the process tests fail.
# nbval's kernels use Unix sockets (tools/nbval_ipc.py): a TCP port picked for a kernel can be taken before the
# kernel binds it.
XDIST ?= -n 2
test: test-unit test-notebooks

# -p no:nbval: the unit tests don't use it, and loading it costs each pytest process ~2.4 s of CPU here (it imports
# nbformat, whose jsonschema builds ~35 parsers at import: python-jsonschema/jsonschema#1428).
# The benchmark scripts' smoke runs (~70 CPU-s) are make test-bench's, which .ci/run runs after make test.
test-unit: env
	$(PY) -m pytest tests -q $(XDIST) -p no:nbval --ignore=tests/project/test_benchmarks.py

# Runs every stored notebook under nbval, which compares each cell's outputs, with the wheel installed outside the
# checkout (as a pip user gets it); NUMERIC_NBS run only with OTHER_KERNELS. Why: a learner's install must give
# the stored outputs, and a float that depends on the CPU must fail here. One pytest session, longest first.
test-notebooks: env
	$(PY) tools/pip_user.py $(addprefix --again ,$(NUMERIC_NBS)) $(addprefix --again-env ,$(OTHER_KERNELS)) \
	    --only-again -- -q $(XDIST) --dist loadfile

# The lowest torch pyproject.toml claims (torch>=2.13), in a venv of its own ($(FLOOR_VENV)): the unit tests, then
# notebooks 0-5 and the exercises run cell by cell (--nbval-lax: any error fails; the stored outputs are
# those of requirements-recorded.txt's torch, so they aren't compared). Not part of make test (it installs a
# second torch, and takes ~20 min); result recorded in docs/maintainers.md, "The torch floor".
FLOOR_TORCH ?= torch==2.13.0+cpu
FLOOR_VENV  ?= .venv-floor
FLOOR_PY     = $(FLOOR_VENV)/bin/python
FLOOR_NBS    = notebooks/00_core_path.ipynb notebooks/01_process_group.ipynb notebooks/02_devices_and_data.ipynb \
               notebooks/03_ddp_gradient_sync.ipynb notebooks/03b_build_ddp_sync.ipynb \
               notebooks/04_two_process_mnist.ipynb notebooks/05_beyond_the_basics.ipynb \
               notebooks/exercises/exercises.ipynb
LISTING_CELLS = --deselect \"notebooks/04_two_process_mnist.ipynb::Cell 2\"
test-floor:
	test -x $(FLOOR_PY) || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install -q --upgrade pip "setuptools>=77" > $(FLOOR_VENV)/install.log 2>&1 || \
	    (tail -20 $(FLOOR_VENV)/install.log; exit 1)
	echo "$(FLOOR_TORCH)" > $(FLOOR_VENV)/floor.txt
	$(FLOOR_PY) tools/pip_progress.py $(FLOOR_VENV)/install.log -- install -e ".[test,vision]" -c $(FLOOR_VENV)/floor.txt
	$(FLOOR_PY) -m ipykernel install --sys-prefix --name python3 > /dev/null
	$(FLOOR_PY) -c "import torch; print('test-floor: torch', torch.__version__)"
	$(FLOOR_PY) -m pytest tests -q $(XDIST) -p no:nbval
	@# The two cells that run the listing's script (torch and torchvision only, as the book's) need a torchvision
	@# that loads with this torch; PyPI's for 2.13 is a CUDA build, which doesn't beside torch 2.13.0+cpu
	@# (download.pytorch.org/whl/cpu has torchvision 0.28.0+cpu). The package itself falls back without one.
	@skip=$$($(FLOOR_PY) -c "import torchvision.datasets" > /dev/null 2>&1 || echo "$(LISTING_CELLS)"); \
	[ -z "$$skip" ] || echo "test-floor: no torchvision loads here: the listing's script cells are left out"; \
	eval PYTHONPATH=tools $(FLOOR_PY) -m pytest -p nbval_ipc --nbval-lax -q -p no:cacheprovider $(XDIST) \
	    --dist loadfile $$skip $(FLOOR_NBS)

# The newest torch (CEILING_TORCH: the newest release on PyPI when it was last run), in a venv of its own
# ($(CEILING_VENV)): the unit tests, then every notebook compared by nbval against its stored outputs, as make
# test-notebooks runs them (tools/pip_user.py): they hold there too (ddp_helpers/common/recorded.py's CHECKED_TORCH,
# where warm_up() prints no version line). Not part of make test (a second torch, ~5 GB from PyPI on Linux; the
# unit tests took 21 min and the notebooks 7 min on the 2-core VM under load: docs/maintainers.md).
# First pip is asked whether it can install that torch at all (--dry-run, in the new venv): where it can't (an index
# without it, a constraints file that caps torch, no network) the target says why and stops with exit status 77
# (automake's "skipped"): never a pass. Results: docs/maintainers.md, "The torch ceiling".
CEILING_TORCH ?= torch==2.15.0
CEILING_VENV  ?= .venv-ceiling
CEILING_PY     = $(CEILING_VENV)/bin/python
test-ceiling:
	test -x $(CEILING_PY) || $(PYTHON) -m venv $(CEILING_VENV)
	@$(CEILING_PY) -m pip install --dry-run -q "$(CEILING_TORCH)" > $(CEILING_VENV)/refused.log 2>&1 || { \
	    echo "test-ceiling: SKIPPED, nothing was run: pip here can't install $(CEILING_TORCH) (exit 77):"; \
	    grep -m 3 -E "ERROR|[Cc]onstraint|conflict" $(CEILING_VENV)/refused.log || tail -3 $(CEILING_VENV)/refused.log; \
	    exit 77; }
	$(CEILING_PY) -m pip install -q --upgrade pip "setuptools>=77" > $(CEILING_VENV)/install.log 2>&1 || \
	    (tail -20 $(CEILING_VENV)/install.log; exit 1)
	echo "$(CEILING_TORCH)" > $(CEILING_VENV)/ceiling.txt
	$(CEILING_PY) tools/pip_progress.py $(CEILING_VENV)/install.log -- install -e ".[test,vision]" -c $(CEILING_VENV)/ceiling.txt
	$(CEILING_PY) -m ipykernel install --sys-prefix --name python3 > /dev/null
	$(CEILING_PY) -c "import torch, torchvision; print('test-ceiling: torch', torch.__version__, 'torchvision', torchvision.__version__)"
	$(CEILING_PY) -m pytest tests -q $(XDIST) -p no:nbval --ignore=tests/project/test_benchmarks.py
	$(CEILING_PY) tools/pip_user.py -- -q $(XDIST) --dist loadfile

test-browser: env
	.ci/install_browser.sh
	$(PY) -m pytest tests/project/test_browser.py -q

solutions: env
	$(PY) -m teacher.solutions

# Teachers (nbgrader; course folder build/nbgrader): the student notebook, generated from
# teacher/nbgrader/source/ and stored executed as notebooks/exercises/exercises.ipynb ...
assignment: env
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m teacher.grading assignment

# ... and autograding with feedback pages: the sample submissions by default; GRADE_ARGS= grades only the
# notebooks placed in build/nbgrader/submitted/<student>/ddp_exercises/. nbgrader runs `alembic` through PATH.
GRADE_ARGS ?= --samples
grade: env
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m teacher.grading grade $(GRADE_ARGS)

# The benchmark scripts still run and print the tables docs/benchmarks.md quotes: short runs, figures unchecked.
# Moved out of make test (issue 52: ~70 CPU-s that prove no behaviour of the package); .ci/run runs it.
.PHONY: test-bench
test-bench: env
	$(PY) -m pytest tests/project/test_benchmarks.py -q $(XDIST) -p no:nbval

bench: env
	$(PY) benchmarks/bench_pipelines.py --markdown

bench-startup: env
	$(PY) benchmarks/startup.py --markdown

bench-launch: env
	$(PY) benchmarks/launch_overhead.py --markdown

bench-allreduce: env
	$(PY) benchmarks/allreduce_latency.py --markdown

bench-threads: env
	$(PY) benchmarks/thread_times.py --markdown

bench-warmth: env
	$(PY) benchmarks/step_warmth.py --markdown

bench-restart: env
	$(PY) benchmarks/kernel_restart.py --markdown

faults: env
	$(PY) benchmarks/fault_detection.py

# Maintainers: re-execute every notebook in place after changing the engine or a notebook (then commit them).
notebooks: env
	$(PY) tools/execute_notebooks.py

# The tutorial as a static website, from the executed notebooks (nothing runs), offline: open docs/_build/html/index.html.
# -W: any warning fails; -n: nitpicky, an unresolved reference is a warning. tests/project/test_site.py builds it the same way.
site: env
	$(PY) -m sphinx -W --keep-going -n -q -b html docs docs/_build/html
	@echo "open docs/_build/html/index.html"

# As root (a container) Jupyter refuses to start without --allow-root; there it also listens on every interface
# without opening a browser, so a published port (docker run -p 8888:8888) reaches it. LAB_ARGS adds options.
LAB_ARGS ?=
LAB_ROOT  = $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root --ip=0.0.0.0 --no-browser)
lab: env
	$(VENV)/bin/jupyter lab $(LAB_ROOT) $(LAB_ARGS) notebooks/

clean:
	rm -rf runs build/nbgrader build/wheel-cache .pytest_cache docs/_build docs/notebooks
