# tch-dist: every target sets itself up on a fresh machine (`make setup` is idempotent and
# near-instant once done).

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Bump when the pinned Python packages change, so `make setup` reinstalls.
SETUP_STAMP := $(VENV)/.tch-dist-setup-3
# torchft: PyTorch's fault tolerance, whose lighthouse, managers and clients tch-dist-ft's
# tests run against (its own dependencies: torch, pinned here, and opentelemetry).
PIP_PACKAGES := torch==2.11.0 "nvidia-cuda-crt==13.0.*" "nvidia-cuda-cccl==13.0.*" scikit-learn==1.9.1 safetensors==0.8.0 torchft==0.2.0
GLOO_HEADER := /usr/include/gloo/config.h
CARGO ?= cargo
NPROC ?= 2

.PHONY: setup demo test lint doc bench gpu-check

# Paths that do not name the venv's Python version (whatever python3 is): the venv's torch
# (.cargo/config.toml's LIBTORCH) and the examples' datasets.
TORCH_LINK := $(VENV)/torch
DIGITS := data/digits.csv.gz
LM_TEXT := data/lm_text.txt

setup: $(SETUP_STAMP) $(GLOO_HEADER) $(TORCH_LINK) $(DIGITS) $(LM_TEXT)

$(SETUP_STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# One wheel at a time and no wheel cache: the CUDA wheels would otherwise need about
	# 8.5 GB free at once (tools/pip_install_lean.py).
	$(PY) tools/pip_install_lean.py $(PIP_PACKAGES)
	touch $@

$(TORCH_LINK): $(SETUP_STAMP)
	ln -sfn "$$($(PY) -c 'import os, torch; print(os.path.dirname(torch.__file__))')" $@

$(DIGITS): $(SETUP_STAMP)
	mkdir -p $(dir $@)
	cp "$$($(PY) -c 'import os, sklearn.datasets as d; print(os.path.join(os.path.dirname(d.__file__), "data", "digits.csv.gz"))')" $@

# train_lm's text: scikit-learn's dataset descriptions (English, about 43 KB), concatenated
# in sorted file order (Python's sort, whatever the locale), written whole then renamed.
$(LM_TEXT): $(SETUP_STAMP)
	mkdir -p $(dir $@)
	$(PY) -c 'import glob, os, sys, sklearn.datasets as d; files = sorted(glob.glob(os.path.join(os.path.dirname(d.__file__), "descr", "*.rst"))); assert files, "no sklearn/datasets/descr/*.rst"; sys.stdout.buffer.write(b"".join(open(f, "rb").read() for f in files))' > $@.tmp
	mv $@.tmp $@

# gloo's headers (Debian's libgloo-dev) let the shim compile ProcessGroupGloo.hpp; gloo
# itself lives inside libtorch_cpu.so.
$(GLOO_HEADER):
	if command -v apt-get >/dev/null; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq libgloo-dev >/dev/null; \
	else echo "install gloo's headers (libgloo-dev) so that $@ exists" >&2; exit 1; fi

demo: setup
	$(CARGO) build --release --bins --examples
	target/release/tch-dist-run --nproc-per-node $(NPROC) -- target/release/examples/allreduce
	target/release/tch-dist-run --nproc-per-node $(NPROC) -- target/release/examples/train_ddp
	target/release/tch-dist-run --nproc-per-node $(NPROC) -- target/release/examples/train_fsdp
	target/release/tch-dist-run --nproc-per-node 2 -- target/release/examples/train_fsdp --pp 2
	target/release/tch-dist-run --nproc-per-node $(NPROC) -- target/release/examples/tensor_parallel
	target/release/tch-dist-run --nproc-per-node 4 -- target/release/examples/train_lm

# Non-incremental, as CI builds: rustc's incremental mode reports some trait errors twice,
# and tests/ui's snapshots hold what a non-incremental build reports.
test: export CARGO_INCREMENTAL = 0
test: setup
	# Everything in one build: the tests, and the examples as plain programs, as the tests
	# run them (tests/common/build.rs then builds nothing more). Not --all-targets: it
	# builds the examples as test harnesses of no tests, and the tests build them again.
	$(CARGO) test --workspace --no-run
	$(CARGO) test --workspace --lib --bins --tests
	# The macros' runnable examples (macros/doc/*.md) run as tch-dist-core's doctests: a
	# proc-macro crate's own doctests cannot link tch.
	$(CARGO) test --workspace --doc --exclude tch-dist-macros

lint: setup
	# README.md's and docs/FROM_PYTORCH.md's Rust blocks compile as copied (no hidden lines).
	$(PYTHON) docs/check_blocks.py --self-test
	$(PYTHON) docs/check_blocks.py
	# Every source folder's table of files (and ffi.rs's of runtime/csrc) matches the folder,
	# and no Markdown page lists files in a table of its own; ARCHITECTURE.md is a map of at
	# most 600 lines; its and docs/design/'s paths and links exist.
	$(PYTHON) docs/check_tables.py --self-test
	$(PYTHON) docs/check_tables.py
	# The figures README.md and docs/PERFORMANCE.md quote are docs/bench_latest.json's.
	$(PYTHON) bench/summary.py check
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps
	# The API reference as docs.rs builds it: no libtorch (tch's doc-only), its own target dir.
	DOCS_RS=1 LIBTORCH=/nonexistent CARGO_TARGET_DIR=target/doc-only RUSTDOCFLAGS="-D warnings" \
	  $(CARGO) doc -p tch-dist --no-deps --features doc-only
	# Every tch-dist item that rustdoc's coverage expects an example on has one (nightly's
	# --show-coverage, its own target dir; skipped, saying so, without a nightly toolchain).
	$(PYTHON) docs/check_examples.py --self-test
	$(PYTHON) docs/check_examples.py

doc: setup
	$(CARGO) doc --workspace --no-deps

# Benchmarks against PyTorch DDP and FSDP (docs/PERFORMANCE.md); never timed tests.
# CPU: the model suite (mlp, transformer, convnet), 2 ranks, Gloo, one torch thread per rank,
# under 10 minutes, then FSDP (fully_shard against PyTorch's, the transformer with AdamW,
# per-block groups; about 1.5 minutes more); a model=NAME line of ratios per model, an
# `fsdp fsdp_vs_pytorch=R fsdp_rss_vs_pytorch=R fsdp_bytes_vs_replicate=R` line, the
# pipeline part (2 stages, Schedule1F1B and zero bubble; ZB-V on 4; pp_ lines) and the 2-D part (4 ranks: HSDP 2x2 and
# FSDP x TP 2x2 against PyTorch's same layouts with AdamW(fused=True), about 2.5 minutes, a
# `two_d hsdp_vs_pytorch=R ...` line), the across-hosts part (bench/hosts.py, root only,
# else skipped with a line saying so: 2 network-namespace hosts x 2 ranks on a 1 Gbit/s tbf
# link, replicate, fully_shard and HSDP against PyTorch's DDP, FSDP2 and HSDP, and the
# replicate hooks; at most 7 minutes, a `hosts ...` line; before it the fault-tolerance
# part, two replica groups against replicate and one fault, an `ft ...` line), and last the MLP's
# tch_dist_vs_pytorch_ddp=<ratio>.
# BENCH_ARGS="--models fsdp" (or pp, two_d, hosts) runs one part alone.
# First the checkpoint part (bench/checkpoint.py, about 3 minutes: save, async_save and
# loads at 2 and 4 ranks of a 403 MB fully_shard model against PyTorch's DCP; its goal lines
# start with ckpt_); BENCH_CHECKPOINT=0 leaves it out.
BENCH_CHECKPOINT ?= 1
# Each part's summary line is then recorded in docs/bench_latest.json (bench/summary.py),
# which README.md and docs/PERFORMANCE.md quote: the quotes are rewritten from it.
bench: setup
	$(CARGO) build --release --bin tch-dist-run --bin tch-dist-lighthouse --example bench_ddp --example bench_checkpoint
	mkdir -p target/bench
	set -o pipefail; if [ "$(BENCH_CHECKPOINT)" != 0 ]; then \
	  PYTHONUNBUFFERED=1 $(PY) bench/checkpoint.py | tee target/bench/checkpoint.log; \
	  $(PYTHON) bench/summary.py record target/bench/checkpoint.log; fi
	set -o pipefail; PYTHONUNBUFFERED=1 $(PY) bench/driver.py $(BENCH_ARGS) | tee target/bench/driver.log
	$(PYTHON) bench/summary.py record target/bench/driver.log

# GPU: builds here and stages into target/gpu-check/ what the GPU machine (torch, no cargo)
# runs in one go: `bash target/gpu-check/run.sh` (carry target/gpu-check).
gpu-check: setup
	$(CARGO) build --release --bin tch-dist-run --example bench_ddp --example gpu_check
	bench/stage_gpu.sh target/gpu-check
