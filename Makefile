# The two commands the README leads with. Each sets itself up (venv + install) on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	@echo "Setting up $(VENV): installing Interlock and its test dependencies (about a minute the first time)"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

# `make demo PORT=8081 METRICS_PORT=9091` when 8080 or 9090 is taken.
demo: $(STAMP)
	$(VENV)/bin/interlock demo $(if $(PORT),--port $(PORT)) $(if $(METRICS_PORT),--metrics-port $(METRICS_PORT))

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
