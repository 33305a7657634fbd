# One set of commands for developers and CI (.ci/run uses the same ones).
.PHONY: sync lint format test test-fast bench-quick wheels

sync:
	uv sync --locked

lint:
	uv run ruff check .
	uv run ruff format --check .

format:
	uv run ruff format .
	uv run ruff check --fix .

test:
	uv run pytest -q -n 2

test-fast:
	uv run pytest -q -n 2 -m "not slow and not gpu"

bench-quick:
	for b in bench/*.py; do uv run python $$b --quick | tail -n 1; done

wheels:
	uv build --all-packages --out-dir dist
