.PHONY: setup test lint
setup:
	scripts/bootstrap
test:
	scripts/test
lint: setup
	.venv/bin/ruff check .
