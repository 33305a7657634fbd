# One set of commands for developers and CI (.ci/run uses the same ones).
.PHONY: sync lint format test test-fast bench-quick wheels

sync:  # the test and lint environment (the default one, `uv sync`, is what the demo imports)
	uv sync --locked --group dev

lint:
	uv run --group dev ruff check .
	uv run --group dev ruff format --check .

format:
	uv run --group dev ruff format .
	uv run --group dev ruff check --fix .

test:
	uv run --group dev pytest -q -n 2

test-fast:
	uv run --group dev pytest -q -n 2 -m "not slow and not gpu"

bench-quick:
	for b in bench/*.py; do uv run python $$b --quick | tail -n 1; done

wheels:
	uv build --all-packages --out-dir dist
